package main

import (
	"io/fs"
	"os/exec"
	"path"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

// ignoreRule is one pattern of a .gitignore or .dockerignore.
type ignoreRule struct {
	pattern  string
	anchored bool // matched from the top, else against any name in the path
	dirOnly  bool
}

// parseIgnore reads the patterns of an ignore file, in the subset of the
// syntax these files use: no negation ("!"), "**" only as a leading "**/".
// docker anchors every pattern; git those with a slash but at the end.
func parseIgnore(t *testing.T, name string, docker bool) []ignoreRule {
	t.Helper()
	var rules []ignoreRule
	for _, l := range lines(readRepoFile(t, name)) {
		l = strings.TrimSpace(l)
		if l == "" || strings.HasPrefix(l, "#") {
			continue
		}
		if strings.HasPrefix(l, "!") || strings.Contains(strings.TrimPrefix(l, "**/"), "**") {
			t.Fatalf("%s: pattern %q uses syntax this test does not read", name, l)
		}
		r := ignoreRule{}
		l, r.dirOnly = strings.CutSuffix(l, "/")
		if p, ok := strings.CutPrefix(l, "**/"); ok {
			r.pattern = p
		} else {
			r.pattern = strings.TrimPrefix(l, "/")
			r.anchored = docker || strings.Contains(l, "/")
		}
		if _, err := path.Match(r.pattern, ""); err != nil {
			t.Fatalf("%s: bad pattern %q: %v", name, l, err)
		}
		rules = append(rules, r)
	}
	return rules
}

// ignored reports whether the rules leave out p (slash-separated, from the
// top; a file unless isDir), itself or as the content of a directory.
func ignored(rules []ignoreRule, p string, isDir bool) bool {
	parts := strings.Split(p, "/")
	for i := range parts {
		dir := i < len(parts)-1 || isDir
		for _, r := range rules {
			if r.dirOnly && !dir {
				continue
			}
			if r.anchored {
				if ok, _ := path.Match(r.pattern, strings.Join(parts[:i+1], "/")); ok {
					return true
				}
				continue
			}
			// Unanchored: the pattern's names end at this one.
			n := strings.Count(r.pattern, "/") + 1
			if i+1 >= n {
				if ok, _ := path.Match(r.pattern, strings.Join(parts[i+1-n:i+1], "/")); ok {
					return true
				}
			}
		}
	}
	return false
}

// repoFiles returns every file of the repository (not .git), slash-separated.
func repoFiles(t *testing.T) []string {
	t.Helper()
	root := repoRoot(t)
	var files []string
	err := filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(root, p)
		if d.IsDir() && rel == ".git" {
			return filepath.SkipDir
		}
		if !d.IsDir() && d.Name() != ".git" { // a worktree's .git is a file
			files = append(files, filepath.ToSlash(rel))
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return files
}

// isSource reports whether a file is part of the project, never a build's
// or a test's leftover.
func isSource(p string) bool {
	switch path.Ext(p) {
	case ".go", ".sql", ".md", ".yml", ".yaml", ".rb", ".mod", ".sum", ".json", ".txt":
		return true
	}
	base := path.Base(p)
	return base == "Dockerfile" || base == ".gitignore" || base == ".dockerignore" ||
		strings.HasPrefix(p, ".ci/") || strings.Contains("/"+p, "/testdata/")
}

// .gitignore leaves out the binaries go build writes (at the top and in a
// command's directory), test binaries, profiles and coverage files, and no
// file of the project: a bare "stagedrain" would hide cmd/stagedrain.
func TestGitignore(t *testing.T) {
	t.Parallel()
	rules := parseIgnore(t, ".gitignore", false)
	for _, p := range []string{"stagedrain", "demoapp", "cmd/stagedrain/stagedrain", "cmd/demoapp/demoapp",
		"relay/relay.test", "stagedrain.test", "coverage.out", "cmd/stagedrain/cover.out", "coverage.html", "relay/cpu.prof"} {
		if !ignored(rules, p, false) {
			t.Errorf(".gitignore does not ignore %s", p)
		}
	}
	for _, p := range append(repoFiles(t), "cmd/stagedrain/main.go", "relay/testdata/fuzz/FuzzX/seed", "testdata/sidekiq/immediate.json") {
		if isSource(p) && ignored(rules, p, false) {
			t.Errorf(".gitignore ignores %s, a file of the project", p)
		}
	}
}

// .dockerignore, at the root where docker-compose.yml and the Dockerfiles
// put the build context, leaves out .git and the tests, and nothing an
// image is built from: every file go build reads for the commands, and
// every source a Dockerfile COPYs.
func TestDockerignore(t *testing.T) {
	t.Parallel()
	rules := parseIgnore(t, ".dockerignore", true)
	for _, p := range []string{".git/HEAD", ".git", "stagedrain", "cmd/stagedrain/stagedrain", "cmd/stagedrain/main_test.go",
		"relay/testdata/fuzz/FuzzX/seed", "testdata/sidekiq/immediate.json", "coverage.out"} {
		if !ignored(rules, p, false) {
			t.Errorf(".dockerignore does not leave out %s", p)
		}
	}
	for _, c := range composeContexts(t) {
		if c != "." {
			t.Errorf("docker-compose.yml builds with the context %q, want . (where .dockerignore is)", c)
		}
	}

	// What go build reads for every command, and go.mod and go.sum.
	cmd := exec.Command("go", "list", "-deps", "-f",
		`{{if .Module}}{{if .Module.Main}}{{.Dir}}|{{join .GoFiles ","}},{{join .CgoFiles ","}},{{join .EmbedFiles ","}}{{end}}{{end}}`, "./cmd/...")
	cmd.Dir = repoRoot(t)
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("go list: %v", err)
	}
	needed := []string{"go.mod", "go.sum"}
	for _, l := range lines(string(out)) {
		dir, files, _ := strings.Cut(l, "|")
		rel, err := filepath.Rel(repoRoot(t), dir)
		if err != nil {
			t.Fatal(err)
		}
		for _, f := range strings.Split(files, ",") {
			if f != "" {
				needed = append(needed, filepath.ToSlash(filepath.Join(rel, f)))
			}
		}
	}
	if len(needed) < 10 {
		t.Fatalf("go list found only %v", needed)
	}
	copySrc := regexp.MustCompile(`(?m)^COPY\s+([^-\n].*)$`)
	for _, df := range []string{"cmd/stagedrain/Dockerfile", "cmd/demoapp/Dockerfile", "cmd/demoworker/Dockerfile"} {
		for _, m := range copySrc.FindAllStringSubmatch(readRepoFile(t, df), -1) {
			srcs := strings.Fields(m[1])
			for _, s := range srcs[:len(srcs)-1] {
				needed = append(needed, path.Clean(s))
			}
		}
	}
	for _, p := range needed {
		if ignored(rules, p, false) || ignored(rules, p, true) {
			t.Errorf(".dockerignore leaves out %s, which an image is built from", p)
		}
	}
}

// composeContexts returns the build context of every service of
// docker-compose.yml that builds an image.
func composeContexts(t *testing.T) []string {
	t.Helper()
	var contexts []string
	for _, m := range regexp.MustCompile(`(?m)^\s+context:\s*(\S+)\s*$`).FindAllStringSubmatch(readRepoFile(t, "docker-compose.yml"), -1) {
		contexts = append(contexts, m[1])
	}
	if len(contexts) < 3 {
		t.Fatalf("docker-compose.yml builds %d images, want 3 (stagedrain, demoapp, demoworker)", len(contexts))
	}
	return contexts
}
