// Package bench is `stagedrain bench`: it measures stagedrain on this
// machine (the app's write throughput with and without the relay and its
// trigger, commit-to-Redis latency, the relay's idle load on PostgreSQL, a
// backlog drain, many schemas, what the trigger costs the app) in a scratch
// database (or schema) and Redis namespace of its own, removed at the end.
// The relay runs as a child process: the stagedrain binary's `run`.
//
// The command line (flags, environment, --quick, usage errors) is the CLI's,
// in cmd/stagedrain/bench.go; this package runs a Config. Its scenarios are
// the table in scenarios.go.
package bench

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net/url"
	"os"
	"os/exec"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/redis/go-redis/v9"

	"github.com/stagedrain/stagedrain/relay"
)

// Config is what one bench run does. The CLI fills it from its flags,
// --quick applied.
type Config struct {
	DatabaseURL string // the user's database; never printed
	RedisURL    string // password never printed
	Exe         string // the stagedrain binary, run as the relay ("run")
	Version     string // the relay's version, for the machine lines

	Target          relay.Target  // the relay's --target: sidekiq, or bullmq or celery (the backlog scenario only)
	Scenarios       []string      // the scenarios to run (Scenarios' names); they run in Scenarios' order
	TPSDuration     time.Duration // per app-TPS scenario
	LatencyDuration time.Duration // per latency rate
	IdleWarmup      time.Duration // relay running before the idle window opens
	IdleWindow      time.Duration // the idle measurement window
	Backlog         int           // jobs staged before the backlog drain, and in the schemas scenario's one schema
	ScaleSteps      []int         // the scale scenario's numbers of schemas
	ScaleWarmup     time.Duration // the scale scenario's IdleWarmup
	ScaleWindow     time.Duration // and IdleWindow
	AppCostSchemas  []int         // the app-cost scenario's fleets: numbers of schemas
	Writers         int           // app writers of the TPS and the 5,000/s scenarios
	Quick           bool          // figures too short for their targets are not judged
	WaitForStandby  bool          // the relays run with --wait-for-standby
	HorizonRate     int           // the horizon scenario's jobs/s (horizon.go)
	HorizonHold     time.Duration // how long it holds the horizon
}

// Run runs cfg's scenarios, in order, with progress lines ("bench: ...") to
// progress, then removes everything it created (also when ctx ends: a
// SIGINT), and, when all went well, writes the machine lines and the result
// table to out. Its errors name no command: the CLI puts "bench: " before
// them.
func Run(ctx context.Context, cfg Config, out, progress io.Writer) error {
	for _, s := range cfg.Scenarios {
		if scenarioNamed(s) == nil {
			return fmt.Errorf("unknown scenario %q, want some of %s", s, strings.Join(Scenarios(), ", "))
		}
	}
	if _, err := redis.ParseURL(cfg.RedisURL); err != nil {
		return errors.New("the Redis URL cannot be parsed") // never echo it: a password
	}
	b := &bench{cfg: cfg, out: progress, exe: cfg.Exe, baseURL: cfg.DatabaseURL, redisURL: cfg.RedisURL}
	runErr := b.run(ctx)
	if ctx.Err() != nil {
		b.progress("interrupted: removing the scratch data")
	}
	cleanErr := b.cleanup(ctx)
	if ctx.Err() != nil {
		if cleanErr != nil {
			return fmt.Errorf("interrupted; cleanup: %w", cleanErr)
		}
		return errors.New("interrupted; scratch data removed")
	}
	if runErr != nil {
		if cleanErr != nil {
			return fmt.Errorf("%w (and cleanup: %v)", runErr, cleanErr)
		}
		return runErr
	}
	if cleanErr != nil {
		return fmt.Errorf("cleanup: %w", cleanErr)
	}
	b.printTable(out)
	return nil
}

// bench is one run of the bench command.
type bench struct {
	cfg      Config
	out      io.Writer // progress
	exe      string    // this binary, run as the relay
	baseURL  string    // the user's database
	redisURL string

	dbURL       string // the database staged_jobs lives in: scratchDB's, or baseURL
	scratchDB   string // "" when the user may not CREATE DATABASE
	database    string // the name of the database of dbURL
	schema      string
	ns          string
	rdb         *redis.Client
	pollOnly    bool       // run --help lists --poll-only
	metricsAddr bool       // run --help lists --metrics-addr
	relay       *relayProc // the running relay, if any
	twin        *relayProc // app-cost's relay of the twin tables, if running
	created     bool       // the scratch schema (or database) may exist
	tenants     []string   // the scratch schemas of the schemas, scale and app-cost scenarios, which may exist
	hungRedis   *hungRedis // the app-cost scenario's Redis that hangs, while it listens

	machine []string
	rows    []benchRow
	peakRSS int64 // bytes, the highest VmHWM of every relay run
}

// benchRow is one line of the result table.
type benchRow struct {
	scenario, offered, achieved, p50, p99, max, target, result, note string
}

func (b *bench) progress(format string, args ...any) {
	fmt.Fprintf(b.out, "bench: "+format+"\n", args...)
}

func (b *bench) run(ctx context.Context) error {
	name := "stagedrain_bench_" + randomHex(6)
	b.schema, b.ns = name, name
	ropts, _ := redis.ParseURL(b.redisURL) // checked by Run
	ropts.ClientName = "stagedrain-bench"
	ropts.DisableIdentity = true
	b.rdb = redis.NewClient(ropts)
	if err := b.setup(ctx, name); err != nil {
		return err
	}
	b.progress("scratch database %s, schema %s, Redis namespace %s (removed at the end)", b.database, b.schema, b.ns)
	for _, s := range scenarios {
		if !slices.Contains(b.cfg.Scenarios, s.name) {
			continue
		}
		if err := s.run(b, ctx); err != nil {
			return fmt.Errorf("%s: %w", s.errPrefix, err)
		}
	}
	return nil
}

// setup creates the scratch database (or, without the privilege, uses the
// user's), migrates the scratch schema in it, and records the machine.
func (b *bench) setup(ctx context.Context, name string) error {
	admin, err := pgx.Connect(ctx, b.baseURL)
	if err != nil {
		return fmt.Errorf("connect to %s: %w", relay.DescribeDatabase(b.baseURL), err)
	}
	defer admin.Close(context.WithoutCancel(ctx))
	var pgVersion string
	if err := admin.QueryRow(ctx, "SHOW server_version").Scan(&pgVersion); err != nil {
		return fmt.Errorf("PostgreSQL version: %w", err)
	}
	info, err := b.rdb.Info(ctx, "server").Result()
	if err != nil {
		return fmt.Errorf("Redis version: %w", err)
	}
	redisVersion := "?"
	for _, l := range strings.Split(info, "\n") {
		if v, ok := strings.CutPrefix(strings.TrimSpace(l), "redis_version:"); ok {
			redisVersion = v
		}
	}
	b.machine = []string{
		fmt.Sprintf("machine: %d CPUs, GOMAXPROCS %d, %s %s/%s", runtime.NumCPU(), runtime.GOMAXPROCS(0), runtime.Version(), runtime.GOOS, runtime.GOARCH),
		fmt.Sprintf("servers: PostgreSQL %s, Redis %s", pgVersion, redisVersion),
		fmt.Sprintf("relay: stagedrain %s, default configuration", b.cfg.Version),
	}

	// A database of its own makes pg_stat_database count only the relay's
	// transactions in the idle scenario.
	// Set before the attempt: an interrupted CREATE DATABASE may still
	// have created it, and cleanup drops it IF EXISTS.
	b.created, b.scratchDB = true, name
	_, err = admin.Exec(ctx, "CREATE DATABASE "+pgx.Identifier{name}.Sanitize())
	var pgErr *pgconn.PgError
	switch {
	case err == nil:
		if b.dbURL, err = withDatabase(b.baseURL, name); err != nil {
			return err
		}
		b.database = name
	case errors.As(err, &pgErr) && pgErr.Code == "42501": // insufficient_privilege
		b.scratchDB = ""
		b.progress("cannot CREATE DATABASE (%s): using a scratch schema of %s; the idle figure then counts every session of that database", pgErr.Message, relay.DescribeDatabase(b.baseURL))
		b.dbURL = b.baseURL
		if err := admin.QueryRow(ctx, "SELECT current_database()").Scan(&b.database); err != nil {
			return err
		}
	default:
		return fmt.Errorf("create scratch database: %w", err)
	}
	conn, err := b.connect(ctx)
	if err != nil {
		return err
	}
	defer conn.Close(context.WithoutCancel(ctx))
	if _, err := relay.Migrate(ctx, conn, b.schema); err != nil {
		return err
	}
	out, err := exec.CommandContext(ctx, b.exe, "run", "--help").Output()
	if err != nil {
		return fmt.Errorf("%s run --help: %w", b.exe, err)
	}
	b.pollOnly = bytes.Contains(out, []byte("--poll-only"))
	b.metricsAddr = bytes.Contains(out, []byte("--metrics-addr"))
	return nil
}

// withDatabase returns databaseURL with its database replaced by name.
func withDatabase(databaseURL, name string) (string, error) {
	if strings.HasPrefix(databaseURL, "postgres://") || strings.HasPrefix(databaseURL, "postgresql://") {
		u, err := url.Parse(databaseURL)
		if err != nil {
			return "", errors.New("the database URL cannot be parsed") // never echo it
		}
		u.Path, u.RawPath = "/"+name, ""
		return u.String(), nil
	}
	return databaseURL + " dbname=" + name, nil // key=value: the last one wins
}

// connect opens a connection to the database of staged_jobs.
func (b *bench) connect(ctx context.Context) (*pgx.Conn, error) {
	conn, err := pgx.Connect(ctx, b.dbURL)
	if err != nil {
		return nil, fmt.Errorf("connect to %s: %w", relay.DescribeDatabase(b.dbURL), err)
	}
	return conn, nil
}

func (b *bench) table() string { return pgx.Identifier{b.schema, "staged_jobs"}.Sanitize() }

// queueKey is the list a queue's jobs land in, under the namespace:
// Sidekiq's queue:<queue>, BullMQ's <queue>:wait (--target bullmq, whose
// prefix is the namespace), or Kombu's list of the queue (--target celery).
func (b *bench) queueKey(queue string) string {
	switch b.cfg.Target {
	case relay.TargetBullMQ:
		return b.ns + ":" + queue + ":wait"
	case relay.TargetCelery:
		return b.ns + ":" + queue
	}
	return b.ns + ":queue:" + queue
}

// reset empties staged_jobs and the scratch Redis keys between scenarios.
func (b *bench) reset(ctx context.Context, conn *pgx.Conn) error {
	return b.resetTables(ctx, conn, []string{b.table()})
}

// resetTables empties the tables (quoted) and the scratch Redis keys.
func (b *bench) resetTables(ctx context.Context, conn *pgx.Conn, tables []string) error {
	if _, err := conn.Exec(ctx, "TRUNCATE "+strings.Join(tables, ", ")); err != nil {
		return fmt.Errorf("truncate staged_jobs: %w", err)
	}
	return b.deleteKeys(ctx)
}

// deleteKeys deletes every key of the scratch namespace.
func (b *bench) deleteKeys(ctx context.Context) error {
	iter := b.rdb.Scan(ctx, 0, b.ns+":*", 1000).Iterator()
	var batch []string
	for iter.Next(ctx) {
		batch = append(batch, iter.Val())
		if len(batch) == 1000 {
			if err := b.rdb.Unlink(ctx, batch...).Err(); err != nil {
				return fmt.Errorf("delete scratch keys: %w", err)
			}
			batch = batch[:0]
		}
	}
	if err := iter.Err(); err != nil {
		return fmt.Errorf("scan scratch keys: %w", err)
	}
	if len(batch) > 0 {
		if err := b.rdb.Unlink(ctx, batch...).Err(); err != nil {
			return fmt.Errorf("delete scratch keys: %w", err)
		}
	}
	return nil
}

// cleanup stops the relay and removes everything the run created. It runs
// after ctx may have ended, so it has a deadline of its own.
func (b *bench) cleanup(parent context.Context) error {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(parent), time.Minute)
	defer cancel()
	var errs []error
	if b.hungRedis != nil {
		// First: a relay's reads from it end at once, and so does the relay.
		b.hungRedis.close()
		b.hungRedis = nil
	}
	if b.relay != nil {
		if _, err := b.stopRelay(); err != nil {
			errs = append(errs, err)
		}
	}
	if b.twin != nil {
		if _, err := b.stopTwin(); err != nil {
			errs = append(errs, err)
		}
	}
	if b.created {
		if err := b.dropScratch(ctx); err != nil {
			errs = append(errs, err)
		}
	}
	if b.rdb != nil {
		if b.ns != "" {
			if err := b.deleteKeys(ctx); err != nil {
				errs = append(errs, err)
			}
		}
		_ = b.rdb.Close()
	}
	return errors.Join(errs...)
}

func (b *bench) dropScratch(ctx context.Context) error {
	admin, err := pgx.Connect(ctx, b.baseURL)
	if err != nil {
		return fmt.Errorf("connect to %s: %w", relay.DescribeDatabase(b.baseURL), err)
	}
	defer admin.Close(ctx)
	if b.scratchDB != "" {
		// FORCE ends the sessions still connected (a killed relay's, say).
		if _, err := admin.Exec(ctx, "DROP DATABASE IF EXISTS "+pgx.Identifier{b.scratchDB}.Sanitize()+" WITH (FORCE)"); err != nil {
			return fmt.Errorf("drop scratch database: %w", err)
		}
		return nil
	}
	if _, err := admin.Exec(ctx, "DROP SCHEMA IF EXISTS "+pgx.Identifier{b.schema}.Sanitize()+" CASCADE"); err != nil {
		return fmt.Errorf("drop scratch schema: %w", err)
	}
	for _, s := range b.tenants {
		if _, err := admin.Exec(ctx, "DROP SCHEMA IF EXISTS "+pgx.Identifier{s}.Sanitize()+" CASCADE"); err != nil {
			return fmt.Errorf("drop scratch schema: %w", err)
		}
	}
	return nil
}

// relayProc is a relay running as a child process.
type relayProc struct {
	cmd  *exec.Cmd
	done chan struct{} // closed once Wait has returned
	err  error         // Wait's result, set before done is closed
}

// startRelay starts `stagedrain run` on the scratch schema and namespace,
// with the relay's default configuration: no STAGEDRAIN_* variable of this
// process reaches it.
func (b *bench) startRelay(pollOnly bool) (*relayProc, error) {
	return b.startRelayOn(pollOnly, "--schema", b.schema)
}

// startRelayOn is startRelay with schemaArgs (--schema or --schemas and its
// value) naming what it drains.
func (b *bench) startRelayOn(pollOnly bool, schemaArgs ...string) (*relayProc, error) {
	return b.startRelayWith(b.redisURL, pollOnly, schemaArgs...)
}

// startRelayWith is startRelayOn with the relay's Redis at redisURL.
func (b *bench) startRelayWith(redisURL string, pollOnly bool, schemaArgs ...string) (*relayProc, error) {
	p, err := b.launchRelay(redisURL, pollOnly, schemaArgs...)
	if err == nil {
		b.relay = p
	}
	return p, err
}

// startTwin starts app-cost's second relay, of the twin tables, beside the
// running one (startRelayOn).
func (b *bench) startTwin(pollOnly bool, schemaArgs ...string) (*relayProc, error) {
	p, err := b.launchRelay(b.redisURL, pollOnly, schemaArgs...)
	if err == nil {
		b.twin = p
	}
	return p, err
}

// launchRelay starts a relay process (startRelayWith).
func (b *bench) launchRelay(redisURL string, pollOnly bool, schemaArgs ...string) (*relayProc, error) {
	args := append([]string{"run"}, schemaArgs...)
	args = append(args, "--target", string(b.cfg.Target), "--redis-namespace", b.ns, "--log-level", "warn")
	if pollOnly && b.pollOnly {
		args = append(args, "--poll-only")
	}
	if b.cfg.WaitForStandby {
		args = append(args, "--wait-for-standby")
	}
	if b.metricsAddr {
		// No HTTP listener: it would take the port of a relay on this host.
		args = append(args, "--metrics-addr=")
	}
	cmd := exec.Command(b.exe, args...)
	for _, kv := range os.Environ() {
		if name, _, _ := strings.Cut(kv, "="); !isStagedrainVar(name) {
			cmd.Env = append(cmd.Env, kv)
		}
	}
	// The URLs go through the environment, not argv, where ps would show
	// a password.
	cmd.Env = append(cmd.Env, "DATABASE_URL="+b.dbURL, "REDIS_URL="+redisURL)
	cmd.Stdout, cmd.Stderr = b.out, b.out // warnings and errors only
	cmd.WaitDelay = 5 * time.Second
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("start relay: %w", err)
	}
	p := &relayProc{cmd: cmd, done: make(chan struct{})}
	go func() {
		p.err = cmd.Wait()
		close(p.done)
	}()
	b.progress("relay started (pid %d)", cmd.Process.Pid)
	return p, nil
}

// isStagedrainVar reports whether the environment variable name configures
// stagedrain.
func isStagedrainVar(name string) bool {
	return name == "DATABASE_URL" || name == "REDIS_URL" || strings.HasPrefix(name, "STAGEDRAIN_")
}

// exited reports the relay's exit, or nil while it runs.
func (p *relayProc) exited() error {
	select {
	case <-p.done:
		if p.err == nil {
			return errors.New("relay exited with status 0")
		}
		return fmt.Errorf("relay exited: %w", p.err)
	default:
		return nil
	}
}

// peakRSS is the relay's peak resident set so far (VmHWM), in bytes.
func (p *relayProc) peakRSS() (int64, error) {
	status, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", p.cmd.Process.Pid))
	if err != nil {
		return 0, fmt.Errorf("read relay peak RSS: %w", err)
	}
	for _, l := range strings.Split(string(status), "\n") {
		if v, ok := strings.CutPrefix(l, "VmHWM:"); ok {
			kb, err := strconv.ParseInt(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(v), "kB")), 10, 64)
			if err != nil {
				return 0, fmt.Errorf("parse VmHWM %q: %w", v, err)
			}
			return kb * 1024, nil
		}
	}
	return 0, errors.New("no VmHWM in /proc/<pid>/status")
}

// cpu is the CPU time the relay has used so far, user and system: utime
// plus stime of /proc/<pid>/stat, in clock ticks of USER_HZ, which Linux
// fixes at 100 a second for every architecture.
func (p *relayProc) cpu() (time.Duration, error) {
	stat, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", p.cmd.Process.Pid))
	if err != nil {
		return 0, fmt.Errorf("read relay CPU time: %w", err)
	}
	// Field 2, the command's name, is in parentheses and may hold spaces:
	// field 3 on are those after the last ')'. utime and stime are fields
	// 14 and 15.
	i := bytes.LastIndexByte(stat, ')')
	fields := strings.Fields(string(stat[i+1:]))
	if i < 0 || len(fields) < 13 {
		return 0, fmt.Errorf("read relay CPU time: /proc/%d/stat has too few fields", p.cmd.Process.Pid)
	}
	var ticks int64
	for _, f := range fields[11:13] {
		n, err := strconv.ParseInt(f, 10, 64)
		if err != nil {
			return 0, fmt.Errorf("read relay CPU time: parse %q: %w", f, err)
		}
		ticks += n
	}
	const userHZ = 100
	return time.Duration(ticks) * time.Second / userHZ, nil
}

// stopRelay records the running relay's peak RSS, then stops it with
// SIGTERM (SIGQUIT, then SIGKILL, if it has not exited 15s later). It returns the peak RSS.
func (b *bench) stopRelay() (int64, error) {
	p := b.relay
	b.relay = nil
	return b.stopProc(p)
}

// stopTwin stops the twin relay, as stopRelay the relay.
func (b *bench) stopTwin() (int64, error) {
	p := b.twin
	b.twin = nil
	return b.stopProc(p)
}

// stopProc stops p (stopRelay).
func (b *bench) stopProc(p *relayProc) (int64, error) {
	var rss int64
	var rssErr error
	// It may have stopped already: a Ctrl-C in a terminal signals the
	// whole process group.
	if p.exited() == nil {
		rss, rssErr = p.peakRSS()
		b.peakRSS = max(b.peakRSS, rss)
		_ = p.cmd.Process.Signal(syscall.SIGTERM)
	}
	select {
	case <-p.done:
	case <-time.After(15 * time.Second):
		// SIGQUIT makes the Go runtime print every goroutine's stack to
		// the relay's stderr (ours) and exit: what it was stuck on.
		_ = p.cmd.Process.Signal(syscall.SIGQUIT)
		select {
		case <-p.done:
		case <-time.After(5 * time.Second):
			_ = p.cmd.Process.Kill()
			<-p.done
		}
		return rss, errors.New("relay still running 15s after SIGTERM: stopped with SIGQUIT (its goroutines are above)")
	}
	if p.err != nil {
		return rss, fmt.Errorf("relay: %w", p.err)
	}
	return rss, rssErr
}

func randomHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

// printTable writes the machine lines and the result table.
func (b *bench) printTable(w io.Writer) {
	for _, l := range b.machine {
		fmt.Fprintln(w, l)
	}
	fmt.Fprintln(w)
	rows := append([]benchRow{{"scenario", "offered/s", "achieved/s", "p50", "p99", "max", "target", "result", "note"}}, b.rows...)
	cells := func(r benchRow) []string {
		cs := []string{r.scenario, r.offered, r.achieved, r.p50, r.p99, r.max, r.target, r.result, r.note}
		for i, c := range cs {
			if c == "" {
				cs[i] = "-"
			}
		}
		return cs
	}
	widths := make([]int, 9)
	for _, r := range rows {
		for i, c := range cells(r) {
			widths[i] = max(widths[i], len(c))
		}
	}
	for _, r := range rows {
		var line strings.Builder
		for i, c := range cells(r) {
			if i > 0 {
				line.WriteString(" | ")
			}
			line.WriteString(c + strings.Repeat(" ", widths[i]-len(c)))
		}
		fmt.Fprintln(w, strings.TrimRight(line.String(), " "))
	}
}
