package main

import (
	"errors"
	"io"
	"slices"
	"strings"
	"testing"
)

// The passwords of the URLs every fuzzed command line starts with.
const (
	fuzzPGPassword    = "fuzz-pg-secret"
	fuzzRedisPassword = "fuzz-redis-secret"
)

// fuzzCommands are the commands FuzzFlags drives, each with what it checks
// before it connects to anything.
func fuzzCommands() []fuzzCommand {
	return []fuzzCommand{
		{"run", func(args []string) error {
			f, c := newRunFlags()
			if err := f.parse(args, io.Discard); err != nil {
				return err
			}
			if _, _, err := c.config(f); err != nil {
				return err
			}
			_, err := c.logger("run", io.Discard)
			return err
		}},
		{"migrate", func(args []string) error {
			f, c := newMigrateFlags()
			if err := f.parse(args, io.Discard); err != nil {
				return err
			}
			if err := c.check(f); err != nil {
				return err
			}
			if _, err := schemasFlag(f, c.schemas); err != nil {
				return err
			}
			_, err := c.logger("migrate", io.Discard)
			return err
		}},
		{"bench", func(args []string) error {
			f, c := newBenchFlags()
			if err := f.parse(args, io.Discard); err != nil {
				return err
			}
			_, err := c.config(f)
			return err
		}},
		{"dead purge", func(args []string) error {
			f, c := newDeadFlags("dead purge", "")
			if err := f.parse(args, io.Discard); err != nil {
				return err
			}
			if err := c.check(f); err != nil {
				return err
			}
			_, _, err := c.targets(f)
			return err
		}},
		{"status", func(args []string) error {
			f, c := newStatusFlags()
			if err := f.parse(args, io.Discard); err != nil {
				return err
			}
			_, err := schemasFlag(f, c.schemas)
			return err
		}},
		{"health", func(args []string) error {
			f, _ := newHealthFlags()
			return f.parse(args, io.Discard)
		}},
	}
}

type fuzzCommand struct {
	name  string
	check func(args []string) error
}

// Whatever the command line and environment, the flag parsing and checks
// of each command (durations, sizes, booleans, URLs, ids, days) never panic,
// and what they reject is a usage error (exit 2) that run prints as one
// line, showing no password. args holds the arguments separated by NUL (an
// argument cannot hold one); env picks one of the command's variables,
// which gets value.
func FuzzFlags(f *testing.F) {
	f.Add(uint8(0), "--batch-size\x005\x00--poll-interval\x001s", uint8(3), "5s")
	f.Add(uint8(0), "--max-payload-bytes=0", uint8(0), "true")
	f.Add(uint8(0), "--poll-only=maybe\x00--timestamp-format\x00millis", uint8(9), "-1ns")
	f.Add(uint8(0), "--bogus\nsecond line", uint8(1), "x")
	f.Add(uint8(1), "--log-level\x00loud", uint8(2), "console")
	f.Add(uint8(2), "--quick\x00--writers\x0099999", uint8(4), "tps,idle")
	f.Add(uint8(2), "--duration=-3s", uint8(5), "0")
	f.Add(uint8(3), "--older-than\x007d", uint8(0), "x")
	f.Add(uint8(3), "4\x005\x00--older-than\x00100001d", uint8(1), "")
	f.Add(uint8(4), "--json=yes", uint8(2), "2")
	f.Add(uint8(5), "--metrics-addr\x00:0", uint8(0), "off")
	f.Fuzz(func(t *testing.T, cmd uint8, line string, env uint8, value string) {
		all := line + value
		if strings.Contains(all, fuzzPGPassword) || strings.Contains(all, fuzzRedisPassword) || strings.ContainsRune(value, 0) {
			return // a password of its own; or no value an environment can hold
		}
		if l := strings.ToLower(all); strings.Contains(l, "ssl") || strings.Contains(l, "file") || strings.Contains(l, "service") {
			return // connection parameters that make pgx read files (/dev/stdin would block)
		}
		cmds := fuzzCommands()
		c := cmds[int(cmd)%len(cmds)]
		args := []string{
			"--database-url", "postgres://u:" + fuzzPGPassword + "@127.0.0.1:1/x",
			"--redis-url", "redis://:" + fuzzRedisPassword + "@127.0.0.1:1/0",
		}
		switch c.name {
		case "migrate", "dead purge", "status":
			args = args[:2]
		case "health":
			args = nil
		}
		if line != "" {
			args = append(args, strings.Split(line, "\x00")...)
		}
		var envs []string
		for _, fs := range commandFlags() {
			if fs.cmd == c.name || (c.name == "dead purge" && fs.cmd == "dead") {
				for _, e := range fs.envs {
					envs = append(envs, e)
				}
			}
		}
		slices.Sort(envs)
		t.Setenv(envs[int(env)%len(envs)], value)

		err := c.check(args)
		if err == nil || errors.Is(err, errHelp) {
			return
		}
		var ue *usageError
		if !errors.As(err, &ue) {
			t.Fatalf("%s %q: error %T %v, want a usage error (exit 2)", c.name, args, err, err)
		}
		shown := usageLine(ue)
		if strings.ContainsAny(shown, "\n\r\v\f\u0085\u2028\u2029") {
			t.Fatalf("%s %q: usage error %q is not one line", c.name, args, shown)
		}
		if strings.Contains(shown, fuzzPGPassword) || strings.Contains(shown, fuzzRedisPassword) {
			t.Fatalf("%s %q: usage error %q shows a password", c.name, args, shown)
		}
	})
}
