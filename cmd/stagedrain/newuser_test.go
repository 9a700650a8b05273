package main

import (
	"flag"
	"strings"
	"testing"

	"github.com/stagedrain/stagedrain/relay/relaytest"
)

// dead --help (and -h, help) prints dead's own help: each subcommand with
// its operands, the flags they share and each one's own, and not the
// top-level list of commands.
func TestDeadHelp(t *testing.T) {
	t.Parallel()
	for _, help := range []string{"--help", "-h", "-help", "help"} {
		t.Run(help, func(t *testing.T) {
			t.Parallel()
			r := runCLI("dead", help)
			if r.code != 0 || r.stderr != "" {
				t.Fatalf("exit code %d, stderr %q; want 0 and nothing", r.code, r.stderr)
			}
			if want := "Usage: stagedrain dead list|retry|purge [flags]\n"; !strings.HasPrefix(r.stdout, want) {
				t.Errorf("help starts %q, want %q", firstLine(r.stdout), want)
			}
			for _, want := range []string{
				"  stagedrain dead list [flags]\n",
				"  stagedrain dead retry [flags] ID...|--all\n",
				"  stagedrain dead purge [flags] ID...|--all|--older-than DURATION\n",
				"\nFlags of every subcommand:\n  --database-url URL\n",
				"  --schema schema\n",
				"\nFlags of dead list:\n  --json\n",
				"\nFlags of dead retry:\n  --all\n",
				"\nFlags of dead purge:\n  --all\n",
				"  --older-than DURATION\n",
			} {
				if !strings.Contains(r.stdout, want) {
					t.Errorf("dead %s does not contain %q:\n%s", help, want, r.stdout)
				}
			}
			// The shared flags once, not once per subcommand.
			if n := strings.Count(r.stdout, "  --database-url"); n != 1 {
				t.Errorf("dead %s lists --database-url %d times, want once:\n%s", help, n, r.stdout)
			}
			if strings.Contains(r.stdout, "stagedrain migrate") {
				t.Errorf("dead %s prints the top-level help:\n%s", help, r.stdout)
			}
		})
	}
}

// --version and -version print what version prints.
func TestVersionFlag(t *testing.T) {
	t.Parallel()
	want := runCLI("version")
	for _, arg := range []string{"--version", "-version"} {
		r := runCLI(arg)
		if r != want || r.code != 0 || !strings.HasPrefix(r.stdout, "stagedrain ") {
			t.Errorf("stagedrain %s = %+v, want %+v as stagedrain version", arg, r, want)
		}
	}
	if r := runCLI("--help"); !strings.Contains(r.stdout, "stagedrain --version") {
		t.Errorf("usage does not mention stagedrain --version:\n%s", r.stdout)
	}
}

// Every flag that takes a value shows a placeholder that says what it is
// (a backquoted word of its usage), never the bare "string" or "value".
func TestFlagPlaceholders(t *testing.T) {
	t.Parallel()
	for _, f := range commandFlags() {
		f.fs.VisitAll(func(fl *flag.Flag) {
			name, _ := flag.UnquoteUsage(fl)
			if name == "string" || name == "value" {
				t.Errorf("%s --%s shows the placeholder %q: put a word of its usage in backquotes", f.cmd, fl.Name, name)
			}
		})
	}
	r := runCLI("run", "--help")
	if !strings.Contains(r.stdout, "\n  --redis-mode mode\n") {
		t.Errorf("run --help does not show \"--redis-mode mode\":\n%s", r.stdout)
	}
}

// A value a flag cannot take is named with the kind of value the flag
// takes and what that accepts, on the command line or from the flag's
// variable (whose value is never echoed), instead of the flag package's
// "parse error".
func TestBadValueSaysWhatIsAccepted(t *testing.T) {
	// Not parallel: t.Setenv.
	db := noDatabaseURL(t)
	tests := []struct {
		args     []string
		env, val string
		want     string
	}{
		{[]string{"run", "--database-url", db, "--poll-only=yes please"}, "", "",
			`stagedrain: run: --poll-only: invalid boolean "yes please" (want true or false, 1 or 0)`},
		{[]string{"dead", "list", "--database-url", db, "--json=maybe"}, "", "",
			`stagedrain: dead list: --json: invalid boolean "maybe" (want true or false, 1 or 0)`},
		{[]string{"run", "--database-url", db, "--batch-size", "many"}, "", "",
			`stagedrain: run: --batch-size: invalid integer "many" (want a whole number, such as 100)`},
		{[]string{"run", "--database-url", db, "--batch-size", "99999999999999999999"}, "", "",
			`stagedrain: run: --batch-size: integer out of range "99999999999999999999" (want a whole number, such as 100)`},
		{[]string{"run", "--database-url", db, "--poll-interval", "5"}, "", "",
			`stagedrain: run: --poll-interval: invalid duration "5" (want a number and a unit: 300ms, 5s, 2m, 1h)`},
		// The flag package would read --poll-only (true), then the operand "false".
		{[]string{"run", "--database-url", db, "--poll-only", "false"}, "", "",
			`stagedrain: run: --poll-only takes its value after "=": --poll-only=false, not --poll-only false`},
		{[]string{"dead", "purge", "-all", "0", "--database-url", db}, "", "",
			`stagedrain: dead purge: --all takes its value after "=": --all=0, not --all 0`},
		{[]string{"run", "--database-url", db}, "STAGEDRAIN_POLL_ONLY", "perhaps-xyz",
			`stagedrain: run: $STAGEDRAIN_POLL_ONLY (--poll-only): invalid boolean (want true or false, 1 or 0)`},
		{[]string{"run", "--database-url", db}, "STAGEDRAIN_SHUTDOWN_TIMEOUT", "soon-xyz",
			`stagedrain: run: $STAGEDRAIN_SHUTDOWN_TIMEOUT (--shutdown-timeout): invalid duration (want a number and a unit: 300ms, 5s, 2m, 1h)`},
	}
	for _, tt := range tests {
		t.Run(strings.Join(tt.args, " ")+" "+tt.env, func(t *testing.T) {
			if tt.env != "" {
				t.Setenv(tt.env, tt.val)
			}
			r := runCLI(tt.args...)
			checkUsageError(t, r)
			if got := strings.TrimSuffix(r.stderr, "\n"); got != tt.want {
				t.Errorf("stderr = %q, want %q", got, tt.want)
			}
		})
	}
}

// dead on a schema that was never migrated says to migrate, exit 1, as
// status does.
func TestDeadNotMigrated(t *testing.T) {
	t.Parallel()
	schema := testSchema(t)
	for _, sub := range [][]string{{"list"}, {"list", "--json"}, {"retry", "--all"}, {"retry", "3"}, {"purge", "--all"}, {"purge", "--older-than", "7d"}} {
		r := runCLI(append(append([]string{"dead"}, sub...), "--database-url", relaytest.DatabaseURL(), "--schema", schema)...)
		checkOneLineError(t, r, 1, "dead "+sub[0]+": ", `."staged_jobs_dead" does not exist: run 'stagedrain migrate' first`)
		if r.stdout != "" {
			t.Errorf("dead %v: stdout %q, want nothing", sub, r.stdout)
		}
	}
}

// A URL whose scheme is not postgres or postgresql (a typo) is named as
// such, with the form wanted, and never shows its password.
func TestDatabaseURLScheme(t *testing.T) {
	t.Parallel()
	for _, args := range [][]string{
		{"migrate", "--database-url", "postgress://u:s3cretpw@127.0.0.1:1/x"},
		{"run", "--database-url", "postgre://u:s3cretpw@127.0.0.1:1/x"},
		{"status", "--database-url", "postgress://u:s3cretpw@127.0.0.1:1/x"},
		{"dead", "list", "--database-url", "pg://u:s3cretpw@127.0.0.1:1/x"},
		{"bench", "--database-url", "PostgreSQL://u:s3cretpw@127.0.0.1:1/x"},
	} {
		scheme, _, _ := strings.Cut(args[len(args)-1], "://")
		r := runCLI(args...)
		checkUsageError(t, r, "--database-url: unknown URL scheme "+`"`+scheme+`"`,
			"want postgres://user:password@host:port/db or postgresql://")
		if strings.Contains(r.stderr, "s3cretpw") || strings.Contains(r.stderr, "keyword/value (") {
			t.Errorf("%v: stderr = %q shows the password or pgx's keyword/value message", args, r.stderr)
		}
	}
}
