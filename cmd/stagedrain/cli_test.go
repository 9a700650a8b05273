package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/stagedrain/stagedrain/relay"

	"github.com/stagedrain/stagedrain/relay/relaytest"
)

// result is what one run() call did.
type result struct {
	code           int
	stdout, stderr string
}

func runCLI(args ...string) result {
	var stdout, stderr bytes.Buffer
	code := run(args, &stdout, &stderr)
	return result{code: code, stdout: stdout.String(), stderr: stderr.String()}
}

// checkUsageError checks that r is a bad command line: exit 2, nothing on
// stdout, and one line on stderr that contains every string of want.
func checkUsageError(t *testing.T, r result, want ...string) {
	t.Helper()
	checkOneLineError(t, r, 2, want...)
	if r.stdout != "" {
		t.Errorf("stdout = %q, want nothing", r.stdout)
	}
}

// checkOneLineError checks the exit code and that stderr is exactly one
// line "stagedrain: ..." containing every string of want.
func checkOneLineError(t *testing.T, r result, code int, want ...string) {
	t.Helper()
	if r.code != code {
		t.Errorf("exit code = %d, want %d (stderr %q)", r.code, code, r.stderr)
	}
	if got := lines(r.stderr); len(got) != 1 || !strings.HasSuffix(r.stderr, "\n") {
		t.Fatalf("stderr = %q, want exactly one line", r.stderr)
	}
	if !strings.HasPrefix(r.stderr, "stagedrain: ") {
		t.Errorf("stderr = %q, want it to start with %q", r.stderr, "stagedrain: ")
	}
	for _, w := range want {
		if !strings.Contains(r.stderr, w) {
			t.Errorf("stderr = %q, want it to contain %q", r.stderr, w)
		}
	}
}

// Every bad command line exits 2 with one line on stderr that names what is
// wrong, and runs nothing.
func TestUsageErrors(t *testing.T) {
	t.Parallel()
	// A database that does not exist: should a check be missing, run and
	// migrate fail at once with exit 1 instead of draining or hanging.
	db := noDatabaseURL(t)
	tests := []struct {
		name string
		args []string
		want []string
	}{
		{"no command", nil, []string{"a command is required"}},
		{"unknown command", []string{"frob"}, []string{`unknown command "frob"`}},
		{"unknown command like a flag", []string{"--database-url", db}, []string{`unknown command "--database-url"`}},
		{"bad flag of run", []string{"run", "--database-url", db, "--bogus"}, []string{"-bogus", "stagedrain run --help"}},
		{"bad flag of migrate", []string{"migrate", "--database-url", db, "--nope"}, []string{"-nope", "stagedrain migrate --help"}},
		{"bad flag of version", []string{"version", "--short"}, []string{"-short"}},
		{"argument after flags", []string{"migrate", "--database-url", db, "extra"}, []string{`unexpected argument "extra"`}},
		{"argument of version", []string{"version", "now"}, []string{`unexpected argument "now"`}},
		{"flag without value", []string{"run", "--database-url"}, []string{"database-url"}},
		{"flag with a line break", []string{"run", "--database-url", db, "--bo\ngus\u2028"}, []string{`--bo\ngus\u2028`}},

		{"missing database url, run", []string{"run"}, []string{"--database-url", "$DATABASE_URL"}},
		{"missing database url, migrate", []string{"migrate"}, []string{"--database-url", "$DATABASE_URL"}},
		{"unparsable database url, run", []string{"run", "--database-url", "postgres://h:badport/x"}, []string{"--database-url"}},
		{"unparsable database url, migrate", []string{"migrate", "--database-url", "postgres://h/x?sslmode=sometimes"}, []string{"--database-url"}},

		{"batch size 0", []string{"run", "--database-url", db, "--batch-size", "0"}, []string{"--batch-size", "got 0"}},
		{"batch size negative", []string{"run", "--database-url", db, "--batch-size", "-5"}, []string{"--batch-size"}},
		{"batch size too big", []string{"run", "--database-url", db, "--batch-size", "100001"}, []string{"--batch-size", "100001"}},
		{"batch size not a number", []string{"run", "--database-url", db, "--batch-size", "many"}, []string{"-batch-size"}},

		{"negative horizon warning", []string{"run", "--database-url", db, "--horizon-warn-after", "-1s"}, []string{"run: --horizon-warn-after", "must not be negative, got -1s"}},

		{"bad timestamp format", []string{"run", "--database-url", db, "--timestamp-format", "nanos"}, []string{"--timestamp-format", "nanos"}},
		{"bench target bullmq beside other scenarios", []string{"bench", "--database-url", db, "--target", "bullmq"}, []string{"bench: --target bullmq runs with --scenarios backlog only"}},
		{"unknown target", []string{"run", "--database-url", db, "--target", "resque"}, []string{"run: --target", `"sidekiq", "asynq", "streams", "bullmq" or "celery", got "resque"`}},
		{"empty target", []string{"run", "--database-url", db, "--target="}, []string{"--target", "must not be empty"}},
		{"unknown source", []string{"run", "--database-url", db, "--source", "good_job"}, []string{"run: --source", `"staged_jobs" or "sidekiq_staged_push", got "good_job"`}},
		{"unknown source to migrate", []string{"migrate", "--database-url", db, "--source", "outbox"}, []string{"migrate: --source", `got "outbox"`}},
		{"asynq with a namespace", []string{"run", "--database-url", db, "--target", "asynq", "--redis-namespace", "app"}, []string{"run: --redis-namespace", "asynq's key names are fixed"}},
		{"millis without sidekiq", []string{"run", "--database-url", db, "--target", "streams", "--timestamp-format", "millis"}, []string{"run: --timestamp-format", "sidekiq target only"}},
		{"stream maxlen negative", []string{"run", "--database-url", db, "--target", "streams", "--stream-maxlen", "-1"}, []string{"run: --stream-maxlen", "negative"}},
		{"max queue length negative", []string{"run", "--database-url", db, "--max-queue-length", "-1"}, []string{"run: --max-queue-length", "negative"}},
		{"memory ratio above 1", []string{"run", "--database-url", db, "--redis-max-memory-ratio", "1.5"}, []string{"run: --redis-max-memory-ratio", "between 0 and 1"}},
		{"stream maxlen without streams", []string{"run", "--database-url", db, "--stream-maxlen", "100"}, []string{"run: --stream-maxlen", "streams target only"}},
		{"queues with an empty name", []string{"run", "--database-url", db, "--queues", "a,,b"}, []string{"run: --queues", "empty queue"}},
		{"queues with a duplicate", []string{"run", "--database-url", db, "--queues", "a, b,a"}, []string{"run: --queues", `names queue "a" twice`}},
		{"bad log level, run", []string{"run", "--database-url", db, "--log-level", "loud"}, []string{"--log-level", "loud"}},
		{"bad log level, migrate", []string{"migrate", "--database-url", db, "--log-level", "loud"}, []string{"--log-level", "loud"}},
		{"bad log format", []string{"migrate", "--database-url", db, "--log-format", "xml"}, []string{"--log-format", "xml"}},
		{"bad redis url", []string{"run", "--database-url", db, "--redis-url", "http://127.0.0.1:6379"}, []string{"--redis-url"}},
		{"unknown redis mode", []string{"run", "--database-url", db, "--redis-mode", "ring"}, []string{"run: --redis-mode", `single, cluster or sentinel, got "ring"`}},
		{"sidekiq on a cluster", []string{"run", "--database-url", db, "--redis-mode", "cluster"}, []string{"run: --redis-mode cluster cannot run the sidekiq target", "Sidekiq does not support Redis Cluster"}},
		{"celery on a cluster", []string{"run", "--database-url", db, "--redis-mode", "cluster", "--target", "celery"}, []string{"run: --redis-mode cluster cannot run the celery target", "does not support Redis Cluster"}},
		{"bench celery beyond backlog", []string{"bench", "--database-url", db, "--target", "celery"}, []string{"bench: --target celery runs with --scenarios backlog only"}},
		{"bench unknown target", []string{"bench", "--database-url", db, "--target", "asynq", "--scenarios", "backlog"}, []string{"bench: --target", `"sidekiq", "bullmq" or "celery", got "asynq"`}},
		{"bad cluster url", []string{"run", "--database-url", db, "--redis-mode", "cluster", "--target", "asynq", "--redis-url", "redis://h:1?addr=nocolon"}, []string{"--redis-url", "cluster URL"}},
		{"sentinel url without master", []string{"run", "--database-url", db, "--redis-mode", "sentinel", "--redis-url", "redis://127.0.0.1:26379/0"}, []string{"--redis-url", "master_name"}},

		{"duration without unit", []string{"run", "--database-url", db, "--poll-interval", "5"}, []string{"-poll-interval"}},
		{"duration not a duration", []string{"run", "--database-url", db, "--shutdown-timeout", "soon"}, []string{"-shutdown-timeout"}},
		{"duration zero", []string{"run", "--database-url", db, "--leader-interval", "0s"}, []string{"--leader-interval", "positive"}},
		{"duration negative", []string{"run", "--database-url", db, "--max-backoff", "-1s"}, []string{"--max-backoff", "positive"}},
		{"poll interval too short", []string{"run", "--database-url", db, "--poll-interval", "1ms"}, []string{"--poll-interval", "10ms"}},
		{"leader interval too short", []string{"run", "--database-url", db, "--leader-interval", "5ms"}, []string{"--leader-interval", "10ms"}},
		{"max backoff too short", []string{"run", "--database-url", db, "--max-backoff", "50ms"}, []string{"--max-backoff", "100ms"}},

		{"health, listener off", []string{"health", "--metrics-addr", "off"}, []string{"health: --metrics-addr is off"}},
		{"health, listener empty", []string{"health", "--metrics-addr="}, []string{"health: --metrics-addr is off"}},
		{"health, no port", []string{"health", "--metrics-addr", "localhost"}, []string{"health: --metrics-addr", "missing port"}},
		{"health, argument", []string{"health", "now"}, []string{`unexpected argument "now"`}},
		{"missing database url, status", []string{"status"}, []string{"--database-url", "$DATABASE_URL"}},
		{"schema too long, status", []string{"status", "--database-url", db, "--schema", strings.Repeat("s", 64)}, []string{"status: --schema", "1 to 63 bytes"}},
		{"bad flag of status", []string{"status", "--database-url", db, "--yaml"}, []string{"-yaml", "stagedrain status --help"}},

		// "" would otherwise quietly mean the default.
		{"empty schema", []string{"run", "--database-url", db, "--schema", ""}, []string{"--schema", "must not be empty"}},
		{"empty timestamp format", []string{"run", "--database-url", db, "--timestamp-format="}, []string{"--timestamp-format", "must not be empty"}},
		{"empty schema, migrate", []string{"migrate", "--database-url", db, "--schema="}, []string{"--schema", "must not be empty"}},
		{"schema too long, run", []string{"run", "--database-url", db, "--schema", strings.Repeat("s", 64)}, []string{"run: --schema", "1 to 63 bytes, got 64"}},
		{"schema too long, migrate", []string{"migrate", "--database-url", db, "--schema", strings.Repeat("s", 64)}, []string{"migrate: --schema", "1 to 63 bytes, got 64"}},
		{"max payload bytes 0", []string{"run", "--database-url", db, "--max-payload-bytes", "0"}, []string{"--max-payload-bytes", "positive"}},
		{"max payload bytes too big", []string{"run", "--database-url", db, "--max-payload-bytes", "1000000000"}, []string{"--max-payload-bytes", "1000000000"}},

		{"dead without subcommand", []string{"dead"}, []string{"dead: a subcommand is required"}},
		{"dead unknown subcommand", []string{"dead", "bury"}, []string{`unknown subcommand "bury"`}},
		{"dead list missing database url", []string{"dead", "list"}, []string{"dead list", "--database-url", "$DATABASE_URL"}},
		{"dead list argument", []string{"dead", "list", "--database-url", db, "7"}, []string{`unexpected argument "7"`}},
		{"dead list bad flag", []string{"dead", "list", "--database-url", db, "--all"}, []string{"-all", "stagedrain dead list --help"}},
		{"dead retry nothing", []string{"dead", "retry", "--database-url", db}, []string{"dead retry", "exactly one of ID...|--all"}},
		{"dead retry ids and all", []string{"dead", "retry", "4", "--database-url", db, "--all"}, []string{"exactly one of"}},
		{"dead retry bad id", []string{"dead", "retry", "--database-url", db, "x1"}, []string{`"x1" is not a row id`}},
		{"dead retry zero id", []string{"dead", "retry", "--database-url", db, "0"}, []string{`"0" is not a row id`}},
		{"dead purge nothing", []string{"dead", "purge", "--database-url", db}, []string{"exactly one of ID...|--all|--older-than DURATION"}},
		{"dead purge all and age", []string{"dead", "purge", "--database-url", db, "--all", "--older-than", "7d"}, []string{"exactly one of"}},
		{"dead purge bad age", []string{"dead", "purge", "--database-url", db, "--older-than", "soon"}, []string{"--older-than", `"soon" is not a duration`}},
		{"dead purge zero age", []string{"dead", "purge", "--database-url", db, "--older-than", "0d"}, []string{"--older-than", "positive"}},
		{"dead purge empty schema", []string{"dead", "purge", "--database-url", db, "--all", "--schema="}, []string{"--schema", "must not be empty"}},
		{"schema too long, run --migrate", []string{"run", "--migrate", "--database-url", db, "--schema", strings.Repeat("s", 64)}, []string{"run: --schema", "1 to 63 bytes"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			checkUsageError(t, runCLI(tt.args...), tt.want...)
		})
	}
}

// A bad value in an environment variable exits 2 naming the variable,
// without echoing the value.
func TestEnvUsageErrors(t *testing.T) {
	// Not parallel: t.Setenv.
	db := noDatabaseURL(t)
	tests := []struct {
		name, env, value string
		args             []string
		want             []string
	}{
		{"batch size", "STAGEDRAIN_BATCH_SIZE", "abc-xyz", []string{"run", "--database-url", db}, []string{"$STAGEDRAIN_BATCH_SIZE", "--batch-size"}},
		{"duration", "STAGEDRAIN_POLL_INTERVAL", "five-xyz", []string{"run", "--database-url", db}, []string{"$STAGEDRAIN_POLL_INTERVAL", "--poll-interval"}},
		{"bool", "STAGEDRAIN_MIGRATE", "perhaps-xyz", []string{"run", "--database-url", db}, []string{"$STAGEDRAIN_MIGRATE", "--migrate"}},
		{"negative horizon warning", "STAGEDRAIN_HORIZON_WARN_AFTER", "-5s", []string{"run", "--database-url", db}, []string{"run: $STAGEDRAIN_HORIZON_WARN_AFTER (--horizon-warn-after)", "must not be negative"}},
		{"zero batch size", "STAGEDRAIN_BATCH_SIZE", "0", []string{"run", "--database-url", db}, []string{"--batch-size"}},
		{"unknown target", "STAGEDRAIN_TARGET", "kafka", []string{"run", "--database-url", db}, []string{"run: $STAGEDRAIN_TARGET (--target)", `got "kafka"`}},
		{"unknown source", "STAGEDRAIN_SOURCE", "jobs", []string{"run", "--database-url", db}, []string{"run: $STAGEDRAIN_SOURCE (--source)", `got "jobs"`}},
		{"log level", "STAGEDRAIN_LOG_LEVEL", "loud", []string{"migrate", "--database-url", db}, []string{"--log-level"}},
		{"database url", "DATABASE_URL", "postgres://u:s3cretpw@h:badport/x", []string{"migrate"}, []string{"--database-url"}},
		{"schema too long, run", "STAGEDRAIN_SCHEMA", strings.Repeat("s", 64), []string{"run", "--database-url", db}, []string{"run: $STAGEDRAIN_SCHEMA (--schema)", "1 to 63 bytes"}},
		{"schema too long, migrate", "STAGEDRAIN_SCHEMA", strings.Repeat("s", 64), []string{"migrate", "--database-url", db}, []string{"migrate: $STAGEDRAIN_SCHEMA (--schema)", "1 to 63 bytes"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Setenv(tt.env, tt.value)
			r := runCLI(tt.args...)
			checkUsageError(t, r, tt.want...)
			if strings.HasSuffix(tt.value, "-xyz") && strings.Contains(r.stderr, "xyz") {
				t.Errorf("stderr = %q echoes the value of $%s", r.stderr, tt.env)
			}
			if strings.Contains(r.stderr, "s3cretpw") {
				t.Errorf("stderr = %q shows the password of $%s", r.stderr, tt.env)
			}
		})
	}
}

// A password in --database-url never reaches stdout or stderr, whatever
// the outcome.
func TestPasswordNeverShown(t *testing.T) {
	t.Parallel()
	const password = "s3cretpw"
	tests := []struct {
		name string
		args []string
		code int
		want []string
	}{
		{"bad port, migrate", []string{"migrate", "--database-url", "postgres://u:s3cretpw@127.0.0.1:badport/x"}, 2, []string{"--database-url"}},
		{"bad port, run", []string{"run", "--database-url", "postgres://u:s3cretpw@127.0.0.1:badport/x"}, 2, []string{"--database-url"}},
		{"bad escape in password", []string{"migrate", "--database-url", "postgres://u:s3cretpw%zz@127.0.0.1:1/x"}, 2, []string{"--database-url"}},
		{"bad option", []string{"run", "--database-url", "postgres://u:s3cretpw@127.0.0.1:1/x?sslmode=sometimes"}, 2, []string{"--database-url"}},
		{"key=value form", []string{"migrate", "--database-url", "host=127.0.0.1 user=u password=s3cretpw port=badport"}, 2, []string{"--database-url"}},
		{"bad log level", []string{"migrate", "--database-url", "postgres://u:s3cretpw@127.0.0.1:1/x", "--log-level", "loud"}, 2, []string{"--log-level"}},
		{"bad cluster url", []string{"run", "--database-url", "postgres://127.0.0.1:1/x", "--redis-mode", "cluster", "--target", "streams", "--redis-url", "redis://u:s3cretpw@h:1?addr=nocolon"}, 2, []string{"--redis-url"}},
		{"sentinel url without master", []string{"run", "--database-url", "postgres://127.0.0.1:1/x", "--redis-mode", "sentinel", "--redis-url", "redis://u:s3cretpw@h:26379/0?password=s3cretpw"}, 2, []string{"--redis-url"}},
		// Nothing listens on port 1: the connection is refused.
		{"connection refused", []string{"migrate", "--database-url", "postgres://u:s3cretpw@127.0.0.1:1/x"}, 1, []string{"connect", "u@127.0.0.1:1/x"}},
		{"connection refused, key=value form", []string{"migrate", "--database-url", "host=127.0.0.1 port=1 user=u password=s3cretpw dbname=x"}, 1, []string{"connect"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			r := runCLI(tt.args...)
			checkOneLineError(t, r, tt.code, tt.want...)
			if strings.Contains(r.stdout, password) || strings.Contains(r.stderr, password) {
				t.Errorf("the password shows: stdout %q, stderr %q", r.stdout, r.stderr)
			}
		})
	}
}

// --help on each command exits 0 and lists every flag with its environment
// variable, and nothing else.
func TestHelp(t *testing.T) {
	t.Parallel()
	common := map[string]string{
		"database-url": "DATABASE_URL",
		"schema":       "STAGEDRAIN_SCHEMA",
		"source":       "STAGEDRAIN_SOURCE",
		"log-format":   "STAGEDRAIN_LOG_FORMAT",
		"log-level":    "STAGEDRAIN_LOG_LEVEL",
	}
	runFlags := map[string]string{
		"redis-url":              "REDIS_URL",
		"redis-mode":             "STAGEDRAIN_REDIS_MODE",
		"target":                 "STAGEDRAIN_TARGET",
		"redis-namespace":        "STAGEDRAIN_REDIS_NAMESPACE",
		"stream-maxlen":          "STAGEDRAIN_STREAM_MAXLEN",
		"max-queue-length":       "STAGEDRAIN_MAX_QUEUE_LENGTH",
		"redis-max-memory-ratio": "STAGEDRAIN_REDIS_MAX_MEMORY_RATIO",
		"batch-size":             "STAGEDRAIN_BATCH_SIZE",
		"poll-interval":          "STAGEDRAIN_POLL_INTERVAL",
		"timestamp-format":       "STAGEDRAIN_TIMESTAMP_FORMAT",
		"leader-interval":        "STAGEDRAIN_LEADER_INTERVAL",
		"max-backoff":            "STAGEDRAIN_MAX_BACKOFF",
		"shutdown-timeout":       "STAGEDRAIN_SHUTDOWN_TIMEOUT",
		"max-payload-bytes":      "STAGEDRAIN_MAX_PAYLOAD_BYTES",
		"poll-only":              "STAGEDRAIN_POLL_ONLY",
		"redis-wait-replicas":    "STAGEDRAIN_REDIS_WAIT_REPLICAS",
		"redis-wait-timeout":     "STAGEDRAIN_REDIS_WAIT_TIMEOUT",
		"wait-for-standby":       "STAGEDRAIN_WAIT_FOR_STANDBY",
		"standby-retention":      "STAGEDRAIN_STANDBY_RETENTION",
		"horizon-warn-after":     "STAGEDRAIN_HORIZON_WARN_AFTER",
		"queues":                 "STAGEDRAIN_QUEUES",
		"schemas":                "STAGEDRAIN_SCHEMAS",
		"tenant-key":             "STAGEDRAIN_TENANT_KEY",
		"migrate":                "STAGEDRAIN_MIGRATE",
		"metrics-addr":           "STAGEDRAIN_METRICS_ADDR",
	}
	migrateFlags := map[string]string{"schemas": "STAGEDRAIN_SCHEMAS"}
	for k, v := range common {
		runFlags[k] = v
		migrateFlags[k] = v
	}
	tests := []struct {
		cmd   string
		flags map[string]string // flag -> environment variable
	}{
		{"migrate", migrateFlags},
		{"run", runFlags},
		{"status", map[string]string{
			"database-url":    "DATABASE_URL",
			"schema":          "STAGEDRAIN_SCHEMA",
			"schemas":         "STAGEDRAIN_SCHEMAS",
			"source":          "STAGEDRAIN_SOURCE",
			"json":            "STAGEDRAIN_STATUS_JSON",
			"redis-url":       "REDIS_URL",
			"redis-mode":      "STAGEDRAIN_REDIS_MODE",
			"redis-namespace": "STAGEDRAIN_REDIS_NAMESPACE",
		}},
		{"health", map[string]string{"metrics-addr": "STAGEDRAIN_METRICS_ADDR"}},
		{"bench", map[string]string{
			"database-url":     "DATABASE_URL",
			"redis-url":        "REDIS_URL",
			"duration":         "STAGEDRAIN_BENCH_DURATION",
			"backlog":          "STAGEDRAIN_BENCH_BACKLOG",
			"writers":          "STAGEDRAIN_BENCH_WRITERS",
			"horizon-rate":     "STAGEDRAIN_BENCH_HORIZON_RATE",
			"horizon-hold":     "STAGEDRAIN_BENCH_HORIZON_HOLD",
			"scenarios":        "STAGEDRAIN_BENCH_SCENARIOS",
			"quick":            "STAGEDRAIN_BENCH_QUICK",
			"wait-for-standby": "STAGEDRAIN_WAIT_FOR_STANDBY",
			"target":           "STAGEDRAIN_TARGET",
		}},
		{"version", nil},
		// dead's own flags say what to do, and have no variable ("").
		{"dead list", map[string]string{"database-url": "DATABASE_URL", "schema": "STAGEDRAIN_SCHEMA", "json": ""}},
		{"dead retry", map[string]string{"database-url": "DATABASE_URL", "schema": "STAGEDRAIN_SCHEMA", "all": ""}},
		{"dead purge", map[string]string{"database-url": "DATABASE_URL", "schema": "STAGEDRAIN_SCHEMA", "all": "", "older-than": ""}},
	}
	for _, tt := range tests {
		for _, help := range []string{"--help", "-h"} {
			t.Run(tt.cmd+" "+help, func(t *testing.T) {
				t.Parallel()
				r := runCLI(append(strings.Fields(tt.cmd), help)...)
				if r.code != 0 || r.stderr != "" {
					t.Fatalf("exit code %d, stderr %q; want 0 and nothing", r.code, r.stderr)
				}
				if want := "Usage: stagedrain " + tt.cmd + " [flags]"; !strings.HasPrefix(r.stdout, want) {
					t.Errorf("help starts %q, want %q", firstLine(r.stdout), want)
				}
				got := helpFlags(r.stdout)
				var gotNames, wantNames []string
				for name := range got {
					gotNames = append(gotNames, name)
				}
				for name, env := range tt.flags {
					wantNames = append(wantNames, name)
					usage, ok := got[name]
					if !ok {
						continue
					}
					if env == "" && strings.Contains(usage, "[$") {
						t.Errorf("--%s: usage %q names a variable, want none", name, usage)
					}
					if env != "" && !strings.Contains(usage, "[$"+env+"]") {
						t.Errorf("--%s: usage %q does not name [$%s]", name, usage, env)
					}
				}
				slices.Sort(gotNames)
				slices.Sort(wantNames)
				if !slices.Equal(gotNames, wantNames) {
					t.Errorf("help lists flags %v, want %v; help:\n%s", gotNames, wantNames, r.stdout)
				}
			})
		}
	}
	for _, args := range [][]string{{"--help"}, {"-h"}, {"help"}} {
		t.Run(strings.Join(args, " "), func(t *testing.T) {
			t.Parallel()
			r := runCLI(args...)
			if r.code != 0 || r.stderr != "" {
				t.Fatalf("exit code %d, stderr %q; want 0 and nothing", r.code, r.stderr)
			}
			for _, cmd := range []string{"stagedrain migrate", "stagedrain run", "stagedrain status", "stagedrain health",
				"stagedrain dead list", "stagedrain dead retry", "stagedrain dead purge", "stagedrain bench", "stagedrain version"} {
				if !strings.Contains(r.stdout, cmd) {
					t.Errorf("usage does not mention %q:\n%s", cmd, r.stdout)
				}
			}
		})
	}
}

// helpFlags maps each flag of a command's help to its usage text: the help
// lists "  --name [value]" lines, each followed by its indented usage.
func helpFlags(help string) map[string]string {
	flags := make(map[string]string)
	ls := lines(help)
	for i, l := range ls {
		rest, ok := strings.CutPrefix(l, "  --")
		if !ok {
			continue
		}
		name, _, _ := strings.Cut(rest, " ")
		usage := ""
		if i+1 < len(ls) {
			usage = strings.TrimSpace(ls[i+1])
		}
		flags[name] = usage
	}
	return flags
}

func firstLine(s string) string {
	l, _, _ := strings.Cut(s, "\n")
	return l
}

func TestVersion(t *testing.T) {
	t.Parallel()
	r := runCLI("version")
	if r.code != 0 || r.stderr != "" {
		t.Fatalf("exit code %d, stderr %q; want 0 and nothing", r.code, r.stderr)
	}
	if !regexp.MustCompile(`^stagedrain \S+\n$`).MatchString(r.stdout) {
		t.Fatalf("stdout = %q, want one line \"stagedrain <version>\"", r.stdout)
	}
}

// migrate creates the schema and its staged_jobs table, logs "migrated",
// and running it again changes nothing and still succeeds.
func TestMigrate(t *testing.T) {
	t.Parallel()
	schema := testSchema(t)
	conn := testConn(t)
	args := []string{"migrate", "--database-url", relaytest.DatabaseURL(), "--schema", schema}

	first := checkMigrated(t, runCLI(args...), schema)
	if !tableExists(t, conn, schema, "staged_jobs") {
		t.Fatalf("%s.staged_jobs does not exist after migrate", schema)
	}
	applied, _ := first["applied"].([]any)
	if !slices.Contains(applied, any("baseline_009.sql")) {
		t.Errorf("first migrate applied %v, want it to include baseline_009.sql (a fresh schema's)", first["applied"])
	}
	// The table works: the relay's staging API can write to it.
	if _, err := relay.NewStager(schema).Stage(context.Background(), conn, relay.Job{Name: "ProbeJob"}); err != nil {
		t.Fatalf("stage into the migrated table: %v", err)
	}

	second := checkMigrated(t, runCLI(args...), schema)
	if applied, ok := second["applied"].([]any); !ok || len(applied) != 0 {
		t.Errorf("second migrate applied %v, want []", second["applied"])
	}
	if first["version"] != second["version"] {
		t.Errorf("version %v after the second migrate, want %v as after the first", second["version"], first["version"])
	}
	if n := stagedCount(t, conn, schema); n != 1 {
		t.Errorf("%d rows staged after the second migrate, want the 1 staged before it", n)
	}
}

// checkMigrated checks that a migrate run succeeded and logged one JSON
// line "migrated" for schema, and returns that line's fields.
func checkMigrated(t *testing.T, r result, schema string) map[string]any {
	t.Helper()
	if r.code != 0 || r.stderr != "" {
		t.Fatalf("migrate: exit code %d, stderr %q; want 0 and nothing", r.code, r.stderr)
	}
	var found map[string]any
	for _, l := range lines(r.stdout) {
		var fields map[string]any
		if err := json.Unmarshal([]byte(l), &fields); err != nil {
			t.Fatalf("migrate logged a line that is not JSON: %q (%v)", l, err)
		}
		if fields["msg"] == "migrated" {
			if found != nil {
				t.Fatalf("migrate logged \"migrated\" twice:\n%s", r.stdout)
			}
			found = fields
		}
	}
	if found == nil {
		t.Fatalf("migrate logged no \"migrated\" line; stdout:\n%s", r.stdout)
	}
	if found["schema"] != schema || found["level"] != "info" || found["logger"] != "stagedrain" {
		t.Errorf("migrated line = %v, want schema %s, level info, logger stagedrain", found, schema)
	}
	return found
}

// A flag on the command line wins over its environment variable, and the
// variable counts when the flag is not given.
func TestFlagWinsOverEnv(t *testing.T) {
	// Not parallel: t.Setenv.
	conn := testConn(t)
	envSchema, flagSchema := testSchema(t), testSchema(t)
	t.Setenv("STAGEDRAIN_SCHEMA", envSchema)
	t.Setenv("DATABASE_URL", relaytest.DatabaseURL())
	t.Setenv("STAGEDRAIN_LOG_LEVEL", "error") // would hide the info line "migrated"

	r := runCLI("migrate", "--schema", flagSchema, "--log-level", "info")
	checkMigrated(t, r, flagSchema)
	if !tableExists(t, conn, flagSchema, "staged_jobs") {
		t.Errorf("migrate --schema %s did not create %s.staged_jobs", flagSchema, flagSchema)
	}
	if schemaExists(t, conn, envSchema) {
		t.Errorf("migrate --schema %s created schema %s of $STAGEDRAIN_SCHEMA", flagSchema, envSchema)
	}

	r = runCLI("migrate")
	if r.code != 0 || r.stderr != "" || r.stdout != "" {
		t.Errorf("migrate with $STAGEDRAIN_LOG_LEVEL=error: exit code %d, stdout %q, stderr %q; want 0 and nothing logged", r.code, r.stdout, r.stderr)
	}
	if !tableExists(t, conn, envSchema, "staged_jobs") {
		t.Errorf("migrate without --schema did not create %s.staged_jobs of $STAGEDRAIN_SCHEMA", envSchema)
	}
}

// A connect error is one line that names each cause once: pgx lists each
// address on a line of its own, and under the default sslmode=prefer a
// rejected role once with TLS and once without.
func TestConnectErrorOnOneLine(t *testing.T) {
	t.Parallel()
	cfg, err := pgx.ParseConfig(relaytest.DatabaseURL())
	if err != nil {
		t.Fatal(err)
	}
	db := fmt.Sprintf("postgres://nosuchrole@%s/%s", net.JoinHostPort(cfg.Host, strconv.Itoa(int(cfg.Port))), cfg.Database)
	const cause = `role "nosuchrole" does not exist`
	for _, cmd := range []string{"migrate", "run"} {
		t.Run(cmd, func(t *testing.T) {
			t.Parallel()
			r := runCLI(cmd, "--database-url", db)
			checkOneLineError(t, r, 1, cause)
			if n := strings.Count(r.stderr, cause); n != 1 {
				t.Errorf("stderr = %q names %q %d times, want once", r.stderr, cause, n)
			}
			if strings.ContainsAny(r.stderr, "\t") || strings.Contains(r.stderr, `\n`) || strings.Contains(r.stderr, `\t`) {
				t.Errorf("stderr = %q, want no tab and no escaped newline or tab", r.stderr)
			}
		})
	}
}

// latestVersion is the schema version this stagedrain needs: the one
// migrate brings a fresh schema to.
func latestVersion(t *testing.T) int {
	t.Helper()
	res, err := relay.Migrate(context.Background(), testConn(t), testSchema(t))
	if err != nil {
		t.Fatal(err)
	}
	return res.Current
}

// --target's help lists the targets as relay.Targets declares them, in
// their order: the command line names no target of its own.
func TestTargetHelpFromSpecs(t *testing.T) {
	const want = "sidekiq, asynq, streams (Redis streams), bullmq (BullMQ 6) or celery (Celery task protocol 2)"
	if got := targetsHelp(); got != want {
		t.Fatalf("--target help lists %q, want %q", got, want)
	}
}
