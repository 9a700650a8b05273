package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/stagedrain/stagedrain/relay"
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

// run --schemas with a pattern that matches no schema holding the table
// says so once, at warn, with the pattern and the table, instead of
// nothing after "starting"; once a schema matches it is found, and the
// warning does not come again.
func TestRunSchemasPatternMatchesNothing(t *testing.T) {
	t.Parallel()
	base, schemas := testSchemas(t, "_a")
	pattern := base + "_*"
	_, ns := relaytest.Redis(t)
	p := startProc(t, "relay", childEnv(), "run", "--schemas", pattern, "--redis-namespace", ns, "--poll-interval", "100ms")
	const msg = "no schema matches a pattern of Schemas yet: waiting for one (stagedrain migrate --schemas)"
	w := p.waitLog(rootLogger, msg, 15*time.Second)
	if w.str("level") != "warn" || w.str("pattern") != pattern || w.str("table") != "staged_jobs" {
		t.Errorf("%s; want level warn, pattern %q, table staged_jobs", w.raw, pattern)
	}
	// Discovery runs every 100ms (jittered): a warning per look would
	// come within 2s.
	if again, err := p.stdout.wait(2*time.Second, func(l logLine) bool { return l.is(rootLogger, msg) && l.index > w.index }); err == nil {
		t.Errorf("the warning came again: %s", again.raw)
	}
	if _, err := relay.Migrate(context.Background(), testConn(t), schemas[0]); err != nil {
		t.Fatal(err)
	}
	found := p.waitLog(rootLogger, "schema found", 15*time.Second)
	if found.str("schema") != schemas[0] {
		t.Errorf("%s; want schema %s", found.raw, schemas[0])
	}
	if n := p.count(rootLogger, msg); n != 1 {
		t.Errorf("%d lines %q, want 1", n, msg)
	}
	p.signal(syscall.SIGTERM)
	if code := p.wait(15 * time.Second); code != 0 {
		t.Fatalf("exit code %d after SIGTERM; output:\n%s", code, p.output())
	}
}

// A wrong PostgreSQL password, under the default sslmode (prefer: TLS
// first, then without) on a server without TLS, exits 1 with one line that
// leads with the server's answer (password authentication failed), not
// with its refusal of TLS; never with the password. A private PostgreSQL
// with scram-sha-256 checks the password (the shared one trusts).
func TestWrongPasswordLeadsWithTheCause(t *testing.T) {
	t.Parallel()
	dir, err := os.MkdirTemp("", "stagedrain-hba-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	hba := filepath.Join(dir, "pg_hba.conf")
	// Readable by the server's OS user (postgres, when the tests run as root).
	if err := os.Chmod(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(hba, []byte("host all postgres 127.0.0.1/32 trust\nhost all all 127.0.0.1/32 scram-sha-256\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	srv := relaytest.StartPostgres(t, "hba_file="+hba)
	admin := relaytest.Conn(t, srv.URL())
	if _, err := admin.Exec(context.Background(), "CREATE ROLE app LOGIN PASSWORD 'right-pw'"); err != nil {
		t.Fatal(err)
	}
	url := fmt.Sprintf("postgres://app:wrong-pw@127.0.0.1:%d/postgres", srv.Port) // no sslmode: prefer
	_, ns := relaytest.Redis(t)
	for _, args := range [][]string{
		{"status", "--database-url", url},
		{"migrate", "--database-url", url},
		{"run", "--database-url", url, "--redis-url", relaytest.RedisURL(), "--redis-namespace", ns},
	} {
		r := runCLI(args...)
		checkOneLineError(t, r, 1, `password authentication failed for user "app"`)
		auth := strings.Index(r.stderr, "password authentication failed")
		if tls := strings.Index(r.stderr, "server refused TLS"); tls >= 0 && tls < auth {
			t.Errorf("%s: stderr %q leads with the TLS refusal, want the password failure first", args[0], r.stderr)
		}
		if strings.Contains(r.stderr, "wrong-pw") || strings.Contains(r.stdout, "wrong-pw") {
			t.Errorf("%s: the output shows the password: %q %q", args[0], r.stdout, r.stderr)
		}
	}
}

// A --metrics-addr that is not host:port (a port alone: 9187) is a bad
// flag value: exit 2 with one line saying what it wants, from the command
// line or its variable, for run and health. (An address in use is exit 1:
// TestMetricsAddrInUse.)
func TestMetricsAddrMalformed(t *testing.T) {
	// Not parallel: t.Setenv.
	db := noDatabaseURL(t)
	for _, tt := range []struct {
		args []string
		env  string
		want string
	}{
		{[]string{"run", "--database-url", db, "--metrics-addr", "9187"}, "", `run: --metrics-addr "9187" is not host:port`},
		{[]string{"run", "--database-url", db, "--metrics-addr", "localhost:"}, "", `run: --metrics-addr "localhost:" is not host:port (no port)`},
		{[]string{"run", "--database-url", db}, "9187", `run: $STAGEDRAIN_METRICS_ADDR (--metrics-addr) "9187" is not host:port`},
		{[]string{"health", "--metrics-addr", "9187"}, "", `health: --metrics-addr "9187" is not host:port`},
	} {
		t.Run(strings.Join(tt.args, " ")+" "+tt.env, func(t *testing.T) {
			if tt.env != "" {
				t.Setenv("STAGEDRAIN_METRICS_ADDR", tt.env)
			}
			checkUsageError(t, runCLI(tt.args...), tt.want, "want :9187 (every address) or 127.0.0.1:9187")
		})
	}
}

// A DATABASE_URL or REDIS_URL without a scheme (host:port/db, user@host/db)
// is a usage error that names the form wanted, not pgx's "failed to parse
// as keyword/value" (or, for user@host/db?sslmode=disable, which pgx reads
// as one odd keyword, a relay that retries a connection to nowhere); a
// keyword/value string still works.
func TestURLWithoutScheme(t *testing.T) {
	t.Parallel()
	// Processes, with a deadline: a check that lets such a URL through
	// leaves run retrying forever.
	exit := func(env string, args ...string) (int, string) {
		t.Helper()
		p := startProc(t, strings.Join(args, " "), childEnv(env), args...)
		code := p.wait(60 * time.Second)
		var stderr []string
		for _, l := range p.stderr.snapshot() {
			stderr = append(stderr, l.raw)
		}
		if len(p.stdout.snapshot()) != 0 || len(stderr) != 1 {
			t.Errorf("%v with %s: stdout %d lines, stderr %q; want nothing and one line", args, env, len(p.stdout.snapshot()), stderr)
		}
		return code, strings.Join(stderr, "\n")
	}
	for _, u := range []string{"127.0.0.1:5432/test", "postgres@127.0.0.1:5432/test?sslmode=disable"} {
		for _, args := range [][]string{{"run"}, {"migrate"}, {"status"}, {"dead", "list"}, {"bench"}} {
			code, stderr := exit("DATABASE_URL="+u, args...)
			for _, want := range []string{"$DATABASE_URL (--database-url): not a URL", "want a URL like postgres://user:password@host:5432/db"} {
				if code != 2 || !strings.Contains(stderr, want) {
					t.Errorf("%v with DATABASE_URL=%s: exit %d, stderr %q; want 2 and %q", args, u, code, stderr, want)
				}
			}
		}
	}
	for _, args := range [][]string{{"run"}, {"status"}, {"bench"}} {
		code, stderr := exit("REDIS_URL=127.0.0.1:6379/0", args...)
		if want := "$REDIS_URL (--redis-url) cannot be parsed (want redis://[user:password@]host:port/db"; code != 2 || !strings.Contains(stderr, want) {
			t.Errorf("%v with REDIS_URL=127.0.0.1:6379/0: exit %d, stderr %q; want 2 and %q", args, code, stderr, want)
		}
	}
	// keyword/value: past the checks, to the server (no such database: 1).
	cfg, err := pgx.ParseConfig(noDatabaseURL(t))
	if err != nil {
		t.Fatal(err)
	}
	kv := fmt.Sprintf("DATABASE_URL=host=%s port=%d user=%s dbname=%s sslmode=disable", cfg.Host, cfg.Port, cfg.User, cfg.Database)
	if code, stderr := exit(kv, "status"); code != 1 || !strings.Contains(stderr, "stagedrain_no_such_database") {
		t.Errorf("status with a keyword/value DATABASE_URL: exit %d, stderr %q; want 1 and the missing database named", code, stderr)
	}
}
