package main

import (
	"os"
	"regexp"
	"strings"
	"testing"
	"time"
)

// TestComposeEnvironment: what docker-compose.yml sets for the demoapp
// service is what demoapp reads, and parses (cmd/stagedrain's compose tests
// check the rest of the file).
func TestComposeEnvironment(t *testing.T) {
	t.Parallel()
	b, err := os.ReadFile("../../docker-compose.yml")
	if err != nil {
		t.Fatal(err)
	}
	// The service: its header, then the lines indented deeper (or blank).
	svc := regexp.MustCompile(`(?m)^  demoapp:\n((?:(?: {4}.*)?\n)*)`).FindSubmatch(b)
	if svc == nil {
		t.Fatal("docker-compose.yml has no demoapp service")
	}
	env := regexp.MustCompile(`(?m)^    environment:\n((?: {6}.*\n)*)`).FindSubmatch(svc[1])
	if env == nil {
		t.Fatalf("the demoapp service has no environment:\n%s", svc[1])
	}
	if regexp.MustCompile(`(?m)^    (command|entrypoint):`).Match(svc[1]) {
		t.Error("the demoapp service sets a command: configure it through its environment, which this test checks")
	}
	known := map[string]bool{}
	for _, fe := range envs {
		known[fe[1]] = true
	}
	vars := map[string]string{}
	for _, line := range strings.Split(strings.TrimRight(string(env[1]), "\n"), "\n") {
		if strings.HasPrefix(strings.TrimSpace(line), "#") {
			continue
		}
		k, v, ok := strings.Cut(strings.TrimSpace(line), ": ")
		if !ok {
			t.Fatalf("environment line %q is not KEY: value", line)
		}
		if !known[k] {
			t.Errorf("docker-compose.yml sets %s for demoapp, which demoapp does not read", k)
		}
		vars[k] = strings.Trim(v, `"'`)
	}
	c, err := parse(nil, func(k string) string { return vars[k] }, nil)
	if err != nil {
		t.Fatalf("demoapp's compose environment %v does not parse: %v", vars, err)
	}
	// A demo a person can follow: users forever, some rolled back, not a flood.
	if c.users != 0 || c.rollbackEvery < 2 || c.interval < 500*time.Millisecond {
		t.Errorf("compose runs demoapp with %+v, want users 0 (forever), rollbacks every 2nd or rarer, an interval of 500ms or more", c)
	}
}
