package main

import (
	"encoding/json"
	"flag"
	"slices"
	"strings"
	"testing"

	"github.com/stagedrain/stagedrain/relay/relaytest"
)

// readmeFlagHeader is the header of README.md's table of every flag.
const readmeFlagHeader = "| flag | environment | default | commands | meaning |"

// flagRow is one row of README.md's flag table.
type flagRow struct {
	env, def string
	// defs are the defaults of the commands whose default is not def: the
	// default cell "`x`; status: (none)" has def `x` and defs[status]
	// (none).
	defs map[string]string
	cmds []string
}

// readmeFlags parses README.md's flag table: flag name -> row.
func readmeFlags(t *testing.T) map[string]flagRow {
	t.Helper()
	ls := lines(readRepoFile(t, "cmd/stagedrain/README.md"))
	i := slices.Index(ls, readmeFlagHeader)
	if i < 0 {
		t.Fatalf("README.md has no table with the header %q", readmeFlagHeader)
	}
	rows := make(map[string]flagRow)
	for _, l := range ls[i+2:] { // past the header and its |---| line
		if !strings.HasPrefix(l, "|") {
			break
		}
		cells := strings.Split(strings.Trim(l, "|"), "|")
		if len(cells) < 5 {
			t.Errorf("README.md flag table: row %q has %d cells, want 5", l, len(cells))
			continue
		}
		for j := range cells {
			cells[j] = strings.TrimSpace(cells[j])
		}
		name, ok := strings.CutPrefix(strings.Trim(cells[0], "`"), "--")
		if !ok {
			t.Errorf("README.md flag table: row %q does not start with a `--flag`", l)
			continue
		}
		if _, dup := rows[name]; dup {
			t.Errorf("README.md flag table: --%s has two rows", name)
		}
		var cmds []string
		for _, c := range strings.Split(cells[3], ",") {
			cmds = append(cmds, strings.TrimSpace(c))
		}
		row := flagRow{env: strings.Trim(cells[1], "`"), cmds: cmds}
		defs := strings.Split(cells[2], "; ")
		row.def = defs[0]
		for _, d := range defs[1:] {
			cmd, def, ok := strings.Cut(d, ": ")
			if !ok {
				t.Errorf("README.md flag table: --%s's default %q, want `x` or `x`; command: `y`", name, cells[2])
				continue
			}
			if row.defs == nil {
				row.defs = make(map[string]string)
			}
			row.defs[cmd] = def
		}
		rows[name] = row
	}
	if len(rows) == 0 {
		t.Fatal("README.md's flag table has no rows")
	}
	return rows
}

// README.md's table lists every flag of every command, with the variable
// and the default the code gives it, and no flag the code does not have.
func TestREADMEFlagTable(t *testing.T) {
	t.Parallel()
	rows := readmeFlags(t)
	code := make(map[string][]string) // flag -> the commands that have it
	for _, f := range commandFlags() {
		f.fs.VisitAll(func(fl *flag.Flag) {
			code[fl.Name] = append(code[fl.Name], f.cmd)
			row, ok := rows[fl.Name]
			if !ok {
				t.Errorf("%s --%s is not in README.md's flag table", f.cmd, fl.Name)
				return
			}
			env := f.envs[fl.Name]
			if env == "" {
				t.Errorf("%s --%s has no environment variable", f.cmd, fl.Name)
			}
			if row.env != env {
				t.Errorf("README.md: --%s reads %q, but %s reads $%s", fl.Name, row.env, f.cmd, env)
			}
			def := row.def
			if d, ok := row.defs[f.cmd]; ok {
				def = d
			}
			want := "`" + fl.DefValue + "`"
			if fl.DefValue == "" {
				if def != "(required)" && def != "(none)" {
					t.Errorf("README.md: --%s defaults to %s, but %s's default is empty: want (required) or (none)", fl.Name, def, f.cmd)
				}
			} else if def != want {
				t.Errorf("README.md: --%s defaults to %s, but %s's default is %s", fl.Name, def, f.cmd, want)
			}
		})
	}
	for name, row := range rows {
		got := slices.Sorted(slices.Values(row.cmds))
		want := slices.Sorted(slices.Values(code[name]))
		if !slices.Equal(got, want) {
			t.Errorf("README.md: --%s is a flag of %v, but the code gives it to %v", name, got, want)
		}
	}
}

func TestUnknownEnv(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name    string
		environ []string
		want    []string
	}{
		{"none", nil, nil},
		{"known, every command", []string{"DATABASE_URL=x", "STAGEDRAIN_SCHEMA=s", "STAGEDRAIN_BATCH_SIZE=5", "STAGEDRAIN_POLL_ONLY=true", "STAGEDRAIN_BENCH_DURATION=1s"}, nil},
		{"typo", []string{"STAGEDRAIN_BATCHSIZE=5"}, []string{"STAGEDRAIN_BATCHSIZE"}},
		{"case matters", []string{"stagedrain_schema=s", "STAGEDRAIN_schema=s"}, []string{"STAGEDRAIN_schema"}},
		{"not ours", []string{"PATH=/bin", "REDIS_NAMESPACE=x", "STAGEDRAINX=1"}, nil},
		{"sorted, once each", []string{"STAGEDRAIN_Z=1", "STAGEDRAIN_A=", "STAGEDRAIN_Z=2", "STAGEDRAIN_="}, []string{"STAGEDRAIN_", "STAGEDRAIN_A", "STAGEDRAIN_Z"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			if got := unknownEnv(tt.environ); !slices.Equal(got, tt.want) {
				t.Errorf("unknownEnv(%q) = %q, want %q", tt.environ, got, tt.want)
			}
		})
	}
}

// An unknown STAGEDRAIN_* variable is named in a warning at start, its value
// never shown, and does not stop the command; a known one, even of another
// command, is not warned about.
func TestUnknownEnvWarned(t *testing.T) {
	// Not parallel: t.Setenv.
	const secret = "s3cret-value"
	t.Setenv("STAGEDRAIN_BATCHSIZE", secret)
	t.Setenv("STAGEDRAIN_BENCH_DURATION", "1s") // bench's, known

	warned := func(t *testing.T, r result) {
		t.Helper()
		var warnings []map[string]any
		for _, l := range lines(r.stdout) {
			var fields map[string]any
			if err := json.Unmarshal([]byte(l), &fields); err != nil {
				t.Fatalf("a line that is not JSON: %q (%v)", l, err)
			}
			if fields["msg"] == "unknown environment variable, ignored" {
				warnings = append(warnings, fields)
			}
		}
		if len(warnings) != 1 {
			t.Fatalf("%d warnings \"unknown environment variable, ignored\", want 1; stdout:\n%s", len(warnings), r.stdout)
		}
		if w := warnings[0]; w["name"] != "STAGEDRAIN_BATCHSIZE" || w["level"] != "warn" || w["logger"] != "stagedrain" {
			t.Errorf("warning = %v, want name STAGEDRAIN_BATCHSIZE, level warn, logger stagedrain", w)
		}
		if strings.Contains(r.stdout+r.stderr, secret) {
			t.Errorf("the value of $STAGEDRAIN_BATCHSIZE shows: stdout %q, stderr %q", r.stdout, r.stderr)
		}
	}

	t.Run("migrate", func(t *testing.T) {
		schema := testSchema(t)
		r := runCLI("migrate", "--database-url", relaytest.DatabaseURL(), "--schema", schema)
		checkMigrated(t, r, schema)
		warned(t, r)
	})
	t.Run("run", func(t *testing.T) {
		_, ns := relaytest.Redis(t)
		// A database that does not exist: run fails at once, after the warning.
		r := runCLI("run", "--database-url", noDatabaseURL(t), "--redis-namespace", ns)
		checkOneLineError(t, r, 1, "stagedrain_no_such_database")
		warned(t, r)
	})
	t.Run("bench", func(t *testing.T) {
		r := runCLI("bench", "--database-url", noDatabaseURL(t), "--quick")
		if r.code != 1 {
			t.Errorf("exit code %d, want 1 (no such database); stderr %q", r.code, r.stderr)
		}
		if !strings.Contains(r.stderr, "bench: unknown environment variable STAGEDRAIN_BATCHSIZE, ignored\n") {
			t.Errorf("stderr = %q, want a line naming STAGEDRAIN_BATCHSIZE", r.stderr)
		}
		if strings.Contains(r.stderr, "STAGEDRAIN_BENCH_DURATION") || strings.Contains(r.stdout+r.stderr, secret) {
			t.Errorf("stderr = %q names a known variable or shows a value", r.stderr)
		}
	})
}
