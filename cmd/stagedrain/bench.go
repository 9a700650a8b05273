package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"os"
	"slices"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/stagedrain/stagedrain/cmd/stagedrain/internal/bench"
	"github.com/stagedrain/stagedrain/relay"
)

// The bench command: its flags and their checks here; the scenarios, the
// scratch data and the table in package bench.

// benchFlags are bench's flags.
type benchFlags struct {
	databaseURL string
	redisURL    string
	duration    time.Duration
	backlog     int
	writers     int
	scenarios   string
	quick       bool
	target      string
	standby     bool
	horizonRate int           // bench_horizon.go
	horizonHold time.Duration // bench_horizon.go
}

func newBenchFlags() (*flagSet, *benchFlags) {
	f := newFlagSet("bench", "Measure stagedrain on this machine: the app's write throughput with and without\n"+
		"the relay and its trigger, commit-to-Redis latency, the relay's idle load on\n"+
		"PostgreSQL, and a backlog drain with the relay's peak memory. Works in a scratch\n"+
		"database (or, without CREATEDB, a scratch schema) and Redis key namespace of its\n"+
		"own, removed at the end and on SIGINT/SIGTERM. Progress goes to stderr, one\n"+
		"table to stdout. The relay runs as a child process: this binary's 'run', with\n"+
		"its default configuration.")
	c := new(benchFlags)
	f.fs.StringVar(&c.databaseURL, "database-url", "", "PostgreSQL connection `URL` (required; never printed)")
	f.env("database-url", "DATABASE_URL")
	f.fs.StringVar(&c.redisURL, "redis-url", "redis://127.0.0.1:6379/0", "Redis `URL` (password never printed)")
	f.env("redis-url", "REDIS_URL")
	f.fs.DurationVar(&c.duration, "duration", 8*time.Second, "length of each app-TPS and latency scenario, and of each of app-cost's runs")
	f.env("duration", "STAGEDRAIN_BENCH_DURATION")
	f.fs.IntVar(&c.backlog, "backlog", 1_000_000, "jobs staged before the backlog drain")
	f.env("backlog", "STAGEDRAIN_BENCH_BACKLOG")
	f.fs.IntVar(&c.writers, "writers", 16, "concurrent app writers of the TPS, app-cost (half on each side) and 5,000 jobs/s scenarios")
	f.env("writers", "STAGEDRAIN_BENCH_WRITERS")
	f.fs.StringVar(&c.scenarios, "scenarios", strings.Join(bench.DefaultScenarios(), ","), "comma-separated `list` of scenarios to run: "+bench.ScenariosHelp())
	f.env("scenarios", "STAGEDRAIN_BENCH_SCENARIOS")
	f.fs.BoolVar(&c.quick, "quick", false, "a smoke run: 500ms scenarios (each until it has 50 jobs), a 1s idle window, a 10,000-job backlog, scale at 1 and 10 schemas only, app-cost's fleets of 4 and 8 (an explicit --duration or --backlog wins); the same rows, none judged")
	f.env("quick", "STAGEDRAIN_BENCH_QUICK")
	f.fs.StringVar(&c.target, "target", "sidekiq", "the job `system` the relay writes: sidekiq; bullmq (BullMQ's wait lists) or celery (Kombu's lists) with --scenarios backlog only")
	f.env("target", "STAGEDRAIN_TARGET")
	f.fs.BoolVar(&c.standby, "wait-for-standby", false, "run the relays with --wait-for-standby (the database needs a streaming standby): latency then includes the replication lag")
	f.env("wait-for-standby", "STAGEDRAIN_WAIT_FOR_STANDBY")
	f.fs.IntVar(&c.horizonRate, "horizon-rate", 2000, "jobs/s the app stages in the horizon scenario")
	f.env("horizon-rate", "STAGEDRAIN_BENCH_HORIZON_RATE")
	f.fs.DurationVar(&c.horizonHold, "horizon-hold", 10*time.Minute, "how long the horizon scenario holds the xmin horizon (a REPEATABLE READ snapshot, as pg_dump's)")
	f.env("horizon-hold", "STAGEDRAIN_BENCH_HORIZON_HOLD")
	f.required("database-url", "redis-url", "scenarios")
	return f, c
}

// config checks the flags and applies --quick to those not given.
func (c *benchFlags) config(f *flagSet) (bench.Config, error) {
	if c.databaseURL == "" {
		return bench.Config{}, usagef("bench: --database-url or $DATABASE_URL is required")
	}
	if err := relay.CheckDatabaseURL(c.databaseURL); err != nil {
		return bench.Config{}, usagef("bench: %s: %s", f.source("database-url"), err)
	}
	if _, err := redis.ParseURL(c.redisURL); err != nil {
		return bench.Config{}, usagef("bench: %s cannot be parsed (want redis://[user:password@]host:port/db, or rediss:// for TLS)", f.source("redis-url"))
	}
	set := make(map[string]bool)
	f.fs.Visit(func(fl *flag.Flag) { set[fl.Name] = true })
	for name := range f.fromEnv {
		set[name] = true
	}
	cfg := bench.Config{
		DatabaseURL: c.databaseURL, RedisURL: c.redisURL,
		TPSDuration: c.duration, LatencyDuration: c.duration,
		IdleWarmup: 10 * time.Second, IdleWindow: 60 * time.Second,
		Backlog: c.backlog, Writers: c.writers, Quick: c.quick, WaitForStandby: c.standby,
		ScaleSteps: []int{1, 10, 100, 1000}, ScaleWarmup: 5 * time.Second, ScaleWindow: 30 * time.Second,
		AppCostSchemas: []int{20, 200}, Target: relay.Target(c.target),
		HorizonRate: c.horizonRate, HorizonHold: c.horizonHold,
	}
	if c.quick {
		cfg.IdleWarmup, cfg.IdleWindow = 500*time.Millisecond, time.Second
		cfg.ScaleSteps, cfg.ScaleWarmup, cfg.ScaleWindow = []int{1, 10}, 500*time.Millisecond, time.Second
		cfg.AppCostSchemas = []int{4, 8}
		if !set["duration"] {
			cfg.TPSDuration, cfg.LatencyDuration = 500*time.Millisecond, 500*time.Millisecond
		}
		if !set["backlog"] {
			cfg.Backlog = 10_000
		}
	}
	if c.duration <= 0 {
		return cfg, usagef("bench: %s must be positive, got %s", f.source("duration"), c.duration)
	}
	if c.backlog < 10 {
		return cfg, usagef("bench: %s must be at least 10, got %d", f.source("backlog"), c.backlog)
	}
	if c.writers < 1 || c.writers > 1000 {
		return cfg, usagef("bench: %s must be between 1 and 1000, got %d", f.source("writers"), c.writers)
	}
	run := make(map[string]bool)
	for _, s := range strings.Split(c.scenarios, ",") {
		s = strings.TrimSpace(s)
		if !slices.Contains(bench.Scenarios(), s) {
			return cfg, usagef("bench: %s: unknown scenario %q, want some of %s", f.source("scenarios"), s, strings.Join(bench.Scenarios(), ", "))
		}
		if !run[s] {
			run[s] = true
			cfg.Scenarios = append(cfg.Scenarios, s)
		}
	}
	switch {
	case cfg.Target != relay.TargetSidekiq && cfg.Target != relay.TargetBullMQ && cfg.Target != relay.TargetCelery:
		return cfg, usagef("bench: %s must be %q, %q or %q, got %q", f.source("target"), relay.TargetSidekiq, relay.TargetBullMQ, relay.TargetCelery, c.target)
	case cfg.Target != relay.TargetSidekiq && (len(run) != 1 || !run["backlog"]):
		return cfg, usagef("bench: %s %s runs with --scenarios backlog only", f.source("target"), cfg.Target)
	}
	return cfg, nil
}

func benchCmd(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	f, c := newBenchFlags()
	if err := f.parse(args, stdout); err != nil {
		return err
	}
	cfg, err := c.config(f)
	if err != nil {
		return err
	}
	for _, name := range unknownEnv(os.Environ()) {
		fmt.Fprintf(stderr, "bench: unknown environment variable %s, ignored\n", name)
	}
	if cfg.Exe, err = os.Executable(); err != nil {
		return fmt.Errorf("bench: find this binary to run the relay: %w", err)
	}
	cfg.Version = versionString()
	if err := bench.Run(ctx, cfg, stdout, stderr); err != nil {
		return fmt.Errorf("bench: %w", err)
	}
	return nil
}
