package main

import (
	"io"
	"maps"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
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
	svc := composeServices(t)["stagedrain"]
	if svc == nil {
		t.Fatal("docker-compose.yml has no stagedrain service")
	}
	f, _ := newRunFlags()
	known := make(map[string]bool)
	for _, env := range f.envs {
		known[env] = true
	}
	env := svc.get("environment")
	if env == nil || len(env.order) < 2 {
		t.Fatalf("the stagedrain service sets %v, want DATABASE_URL and REDIS_URL at least", env)
	}
	for _, name := range env.order {
		if !known[name] {
			t.Errorf("docker-compose.yml sets %s, which stagedrain run does not read", name)
		}
	}

	args := svc.flowList("command")
	if len(args) == 0 || args[0] != "run" {
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
	var dfHealth []string
	if m := regexp.MustCompile(`(?m)^\s+CMD \[(.*)\]$`).FindStringSubmatch(df); m != nil {
		dfHealth = splitFlowList(m[1])
	}
	composeHealth := svc.flowList("healthcheck", "test")
	if len(composeHealth) > 0 && composeHealth[0] != "CMD" {
		t.Errorf("compose healthcheck %v, want [\"CMD\", ...] (no shell in the image)", composeHealth)
	}
	for name, args := range map[string][]string{
		"Dockerfile HEALTHCHECK": dfHealth,
		"compose healthcheck":    composeHealth[min(1, len(composeHealth)):],
	} {
		if len(args) < 2 || args[0] != binPath[1] || args[1] != "health" {
			t.Errorf("%s runs %v, want %s health", name, args, binPath[1])
			continue
		}
		hf, _ := newHealthFlags()
		if err := hf.parse(args[2:], io.Discard); err != nil {
			t.Errorf("%s %v does not parse: %v", name, args, err)
		}
	}

	if got := svc.value("build", "dockerfile"); got != "cmd/stagedrain/Dockerfile" {
		t.Fatalf("compose builds stagedrain with dockerfile %q, want cmd/stagedrain/Dockerfile", got)
	}
	checkDockerfileCopiesSources(t, "cmd/stagedrain/Dockerfile", ".")
}

// TestComposeTellsTheWholeStory checks the compose file's services and how
// they depend on each other: PostgreSQL and Redis; the relay, scalable to a
// standby (no fixed name or host port); the demo app (cmd/demoapp), started
// once the relay is healthy, that is once run --migrate has made staged_jobs;
// and the Sidekiq worker (cmd/demoworker) on the Redis the relay pushes to.
func TestComposeTellsTheWholeStory(t *testing.T) {
	t.Parallel()
	services := composeServices(t)
	var names []string
	for name := range services {
		names = append(names, name)
	}
	slices.Sort(names)
	if want := []string{"demoapp", "demoworker", "postgres", "redis", "stagedrain"}; !slices.Equal(names, want) {
		t.Fatalf("docker-compose.yml has services %v, want %v", names, want)
	}

	relay := services["stagedrain"]
	for _, key := range []string{"container_name", "ports"} {
		if relay.get(key) != nil {
			t.Errorf("the stagedrain service sets %s, so docker compose up --scale stagedrain=2 cannot start a second one", key)
		}
	}

	// depends_on, with the condition of each: a service is started once
	// those it needs are healthy, and each of those has a healthcheck.
	wantDeps := map[string]map[string]string{
		"postgres":   {},
		"redis":      {},
		"stagedrain": {"postgres": "service_healthy", "redis": "service_healthy"},
		"demoapp":    {"postgres": "service_healthy", "stagedrain": "service_healthy"},
		"demoworker": {"redis": "service_healthy"},
	}
	for name, want := range wantDeps {
		got := map[string]string{}
		if deps := services[name].get("depends_on"); deps != nil {
			if len(deps.items) > 0 {
				t.Errorf("%s: depends_on is a list %v; want conditions (a list waits for nothing but the start)", name, deps.items)
			}
			for _, dep := range deps.order {
				got[dep] = deps.value(dep, "condition")
			}
		}
		if !maps.Equal(got, want) {
			t.Errorf("%s depends on %v, want %v", name, got, want)
		}
		for dep, cond := range got {
			if cond == "service_healthy" && services[dep] != nil && services[dep].get("healthcheck", "test") == nil {
				t.Errorf("%s waits for %s to be healthy, which has no healthcheck", name, dep)
			}
		}
	}

	// The demo's two programs are built from their directories under cmd/,
	// with the repository root as context.
	for name, dockerfile := range map[string]string{
		"demoapp":    "cmd/demoapp/Dockerfile",
		"demoworker": "cmd/demoworker/Dockerfile",
	} {
		svc := services[name]
		if ctx, got := svc.value("build", "context"), svc.value("build", "dockerfile"); ctx != "." || got != dockerfile {
			t.Errorf("%s builds from context %q with dockerfile %q, want . and %s", name, ctx, got, dockerfile)
		}
	}
	checkDockerfileCopiesSources(t, "cmd/demoapp/Dockerfile", "../demoapp")
	if df := readRepoFile(t, "cmd/demoapp/Dockerfile"); !strings.Contains(df, "go build") || !strings.Contains(df, "./cmd/demoapp\n") {
		t.Errorf("cmd/demoapp/Dockerfile does not go build ./cmd/demoapp:\n%s", df)
	}
	worker := readRepoFile(t, "cmd/demoworker/Dockerfile")
	copied := regexp.MustCompile(`(?m)^COPY cmd/demoworker/worker\.rb (\S+)$`).FindStringSubmatch(worker)
	cmd := regexp.MustCompile(`(?m)^CMD \[(.*)\]$`).FindStringSubmatch(worker)
	if copied == nil || cmd == nil {
		t.Fatalf("cmd/demoworker/Dockerfile must COPY cmd/demoworker/worker.rb and have a CMD [...]:\n%s", worker)
	}
	if args := splitFlowList(cmd[1]); len(args) < 3 || args[0] != "sidekiq" || args[1] != "--require" || args[2] != copied[1] {
		t.Errorf("the worker image runs %v, want sidekiq --require %s", args, copied[1])
	}
	if !regexp.MustCompile(`(?m)^RUN gem install sidekiq\b`).MatchString(worker) {
		t.Errorf("cmd/demoworker/Dockerfile does not gem install sidekiq:\n%s", worker)
	}

	// The app writes to the database the relay drains, in its schema; the
	// worker reads the Redis the relay pushes to.
	for _, same := range []struct{ svc, key, relayKey string }{
		{"demoapp", "DATABASE_URL", "DATABASE_URL"},
		{"demoapp", "DEMOAPP_SCHEMA", "STAGEDRAIN_SCHEMA"},
		{"demoworker", "REDIS_URL", "REDIS_URL"},
	} {
		got, want := services[same.svc].value("environment", same.key), relay.value("environment", same.relayKey)
		if got == "" || got != want {
			t.Errorf("%s sets %s=%q, the relay %s=%q: they must match", same.svc, same.key, got, same.relayKey, want)
		}
	}
}

// checkDockerfileCopiesSources checks that the Dockerfile COPYs every
// directory of this repository that the package pkg (relative to this
// directory) is built from.
func checkDockerfileCopiesSources(t *testing.T, dockerfile, pkg string) {
	t.Helper()
	copied := make(map[string]bool)
	for _, m := range regexp.MustCompile(`(?m)^COPY (\S+) \./\S+$`).FindAllStringSubmatch(readRepoFile(t, dockerfile), -1) {
		copied[m[1]] = true
	}
	out, err := exec.Command("go", "list", "-deps", "-f", "{{if not .Standard}}{{.Dir}}{{end}}", pkg).Output()
	if err != nil {
		t.Fatalf("go list %s: %v", pkg, err)
	}
	root := repoRoot(t)
	for _, dir := range strings.Fields(string(out)) {
		rel, err := filepath.Rel(root, dir)
		if err != nil || strings.HasPrefix(rel, "..") {
			continue // a module dependency, downloaded in the image
		}
		if top := strings.Split(rel, string(filepath.Separator))[0]; !copied[top] {
			t.Errorf("%s: the binary is built from %s, but the Dockerfile does not COPY %s", dockerfile, rel, top)
		}
	}
}

// yamlNode is a node of the little YAML that docker-compose.yml is written
// in: block mappings of plain or quoted scalars and flow lists ([...]), and
// block lists ("- item"). Enough to read the compose file here, where no
// Docker engine runs and no YAML library is a dependency; CI checks the
// whole syntax with docker-compose config.
type yamlNode struct {
	scalar string               // the text after "key:", "" for a mapping
	keys   map[string]*yamlNode // a mapping's entries
	order  []string             // their keys, in file order
	items  []string             // a block list's items
}

// get follows path through mappings; nil if any key is missing.
func (n *yamlNode) get(path ...string) *yamlNode {
	for _, k := range path {
		if n == nil {
			return nil
		}
		n = n.keys[k]
	}
	return n
}

// value is the scalar at path, unquoted; "" if missing.
func (n *yamlNode) value(path ...string) string {
	v := n.get(path...)
	if v == nil {
		return ""
	}
	return unquote(v.scalar)
}

// flowList is the flow list ["a", "b"] at path, unquoted; nil if missing.
func (n *yamlNode) flowList(path ...string) []string {
	v := n.get(path...)
	if v == nil || !strings.HasPrefix(v.scalar, "[") || !strings.HasSuffix(v.scalar, "]") {
		return nil
	}
	return splitFlowList(strings.TrimSuffix(strings.TrimPrefix(v.scalar, "["), "]"))
}

func splitFlowList(s string) []string {
	var out []string
	for _, a := range strings.Split(s, ",") {
		out = append(out, unquote(strings.TrimSpace(a)))
	}
	return out
}

func unquote(s string) string {
	if len(s) >= 2 && (s[0] == '"' || s[0] == '\'') && s[len(s)-1] == s[0] {
		return s[1 : len(s)-1]
	}
	return s
}

func parseYAML(t *testing.T, text string) *yamlNode {
	t.Helper()
	type level struct {
		indent int
		node   *yamlNode
	}
	root := &yamlNode{keys: map[string]*yamlNode{}}
	stack := []level{{-1, root}}
	for i, line := range strings.Split(text, "\n") {
		trimmed := strings.TrimSpace(line)
		if trimmed == "" || strings.HasPrefix(trimmed, "#") {
			continue
		}
		indent := len(line) - len(strings.TrimLeft(line, " "))
		for stack[len(stack)-1].indent >= indent {
			stack = stack[:len(stack)-1]
		}
		parent := stack[len(stack)-1].node
		if item, ok := strings.CutPrefix(trimmed, "- "); ok {
			parent.items = append(parent.items, item)
			continue
		}
		key, val, ok := strings.Cut(trimmed, ":")
		if !ok || (val != "" && val[0] != ' ') {
			t.Fatalf("docker-compose.yml:%d: %q is not a \"key: value\" line this test reads", i+1, line)
		}
		if _, dup := parent.keys[key]; dup {
			t.Fatalf("docker-compose.yml:%d: %s given twice", i+1, key)
		}
		n := &yamlNode{scalar: strings.TrimSpace(val), keys: map[string]*yamlNode{}}
		parent.keys[key] = n
		parent.order = append(parent.order, key)
		if n.scalar == "" {
			stack = append(stack, level{indent, n})
		}
	}
	return root
}

// composeServices parses docker-compose.yml and returns its services.
func composeServices(t *testing.T) map[string]*yamlNode {
	t.Helper()
	services := parseYAML(t, readRepoFile(t, "docker-compose.yml")).get("services")
	if services == nil {
		t.Fatal("docker-compose.yml has no services")
	}
	return services.keys
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

// The image's binary is built with -tags grpcnotrace, and with that tag no
// package linked into stagedrain reaches text/template: through gRPC's
// golang.org/x/net/trace (html/template) it did, and a reachable
// reflect.Value.MethodByName makes the linker keep every exported method of
// every type converted to an interface (go-redis's command set alone: 4.3
// MB of code instead of 0.9). The binary was 43 MB instead of 30, and a
// relay's RSS about 3 MiB more, most of it the binary's own pages.
func TestImageBinaryLeavesOutTemplates(t *testing.T) {
	t.Parallel()
	df := readRepoFile(t, "cmd/stagedrain/Dockerfile")
	build := regexp.MustCompile(`(?m)^RUN .*go build (.*) \./cmd/stagedrain$`).FindStringSubmatch(df)
	if build == nil || !regexp.MustCompile(`(^|\s)-tags grpcnotrace(\s|$)`).MatchString(build[1]) {
		t.Fatalf("the Dockerfile's go build of ./cmd/stagedrain (%v) has no -tags grpcnotrace", build)
	}
	out, err := exec.Command("go", "list", "-tags", "grpcnotrace", "-deps", ".").Output()
	if err != nil {
		t.Fatalf("go list: %v", err)
	}
	for _, pkg := range strings.Fields(string(out)) {
		if pkg == "text/template" || pkg == "html/template" || pkg == "golang.org/x/net/trace" {
			t.Errorf("built with -tags grpcnotrace, stagedrain still links %s", pkg)
		}
	}
}
