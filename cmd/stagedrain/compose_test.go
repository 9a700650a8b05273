package main

import (
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

// docker-compose.yml and the Dockerfile cannot be run here (no Docker
// engine; CI checks the compose file's syntax with docker-compose config).
// This test keeps them in step with the code: every variable the compose
// file sets is one stagedrain reads, its command parses, and the Dockerfile
// copies every directory the binary is built from.
func TestComposeAndDockerfileMatchTheCode(t *testing.T) {
	t.Parallel()
	compose := readRepoFile(t, "docker-compose.yml")

	// The stagedrain service: from its header to the next top-level-indented key.
	svc := regexp.MustCompile(`(?ms)^  stagedrain:\n(.*?)(?:^\S|\z)`).FindStringSubmatch(compose)
	if svc == nil {
		t.Fatal("docker-compose.yml has no stagedrain service")
	}
	f, _ := newRunFlags()
	known := make(map[string]bool)
	for _, env := range f.envs {
		known[env] = true
	}
	vars := regexp.MustCompile(`(?m)^\s+((?:STAGEDRAIN_|DATABASE_URL|REDIS_URL)\w*):`).FindAllStringSubmatch(svc[1], -1)
	if len(vars) < 2 {
		t.Fatalf("the stagedrain service sets %d stagedrain variables, want DATABASE_URL and REDIS_URL at least", len(vars))
	}
	for _, v := range vars {
		if !known[v[1]] {
			t.Errorf("docker-compose.yml sets %s, which stagedrain run does not read", v[1])
		}
	}

	cmd := regexp.MustCompile(`(?m)^\s+command:\s*\[(.*)\]`).FindStringSubmatch(svc[1])
	if cmd == nil {
		t.Fatal("the stagedrain service has no command: [...]")
	}
	var args []string
	for _, a := range strings.Split(cmd[1], ",") {
		args = append(args, strings.Trim(strings.TrimSpace(a), `"`))
	}
	if args[0] != "run" {
		t.Fatalf("compose command %v, want run ...", args)
	}
	rf, _ := newRunFlags()
	if err := rf.parse(args[1:], io.Discard); err != nil {
		t.Fatalf("compose command %v does not parse: %v", args, err)
	}

	// Both healthchecks run stagedrain health, at the path the image puts
	// the binary, with arguments health accepts.
	df := readRepoFile(t, "cmd/stagedrain/Dockerfile")
	binPath := regexp.MustCompile(`(?m)^COPY --from=build /out/stagedrain (\S+)$`).FindStringSubmatch(df)
	if binPath == nil {
		t.Fatal("the Dockerfile does not COPY /out/stagedrain into the image")
	}
	for name, hc := range map[string][]string{
		"Dockerfile HEALTHCHECK": regexp.MustCompile(`(?m)^\s+CMD \[(.*)\]$`).FindStringSubmatch(df),
		"compose healthcheck":    regexp.MustCompile(`(?m)^\s+test:\s*\[(.*)\]`).FindStringSubmatch(svc[1]),
	} {
		if hc == nil {
			t.Errorf("%s: none running stagedrain health", name)
			continue
		}
		var args []string
		for _, a := range strings.Split(hc[1], ",") {
			args = append(args, strings.Trim(strings.TrimSpace(a), `"`))
		}
		if name == "compose healthcheck" {
			if args[0] != "CMD" {
				t.Errorf("%s %v, want [\"CMD\", ...] (no shell in the image)", name, args)
				continue
			}
			args = args[1:]
		}
		if len(args) < 2 || args[0] != binPath[1] || args[1] != "health" {
			t.Errorf("%s runs %v, want %s health", name, args, binPath[1])
			continue
		}
		hf, _ := newHealthFlags()
		if err := hf.parse(args[2:], io.Discard); err != nil {
			t.Errorf("%s %v does not parse: %v", name, args, err)
		}
	}

	dockerfile := regexp.MustCompile(`(?m)^\s+dockerfile:\s*(\S+)`).FindStringSubmatch(svc[1])
	if dockerfile == nil || dockerfile[1] != "cmd/stagedrain/Dockerfile" {
		t.Fatalf("compose builds with dockerfile %v, want cmd/stagedrain/Dockerfile", dockerfile)
	}
	copied := make(map[string]bool)
	for _, m := range regexp.MustCompile(`(?m)^COPY (\S+) \./\S+$`).FindAllStringSubmatch(readRepoFile(t, "cmd/stagedrain/Dockerfile"), -1) {
		copied[m[1]] = true
	}
	out, err := exec.Command("go", "list", "-deps", "-f", "{{if not .Standard}}{{.Dir}}{{end}}", ".").Output()
	if err != nil {
		t.Fatalf("go list: %v", err)
	}
	root := repoRoot(t)
	for _, dir := range strings.Fields(string(out)) {
		rel, err := filepath.Rel(root, dir)
		if err != nil || strings.HasPrefix(rel, "..") {
			continue // a module dependency, downloaded in the image
		}
		if top := strings.Split(rel, string(filepath.Separator))[0]; !copied[top] {
			t.Errorf("the binary is built from %s, but the Dockerfile does not COPY %s", rel, top)
		}
	}
}

func repoRoot(t *testing.T) string {
	t.Helper()
	root, err := filepath.Abs("../..")
	if err != nil {
		t.Fatal(err)
	}
	return root
}

func readRepoFile(t *testing.T, name string) string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(repoRoot(t), name))
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}
