package relaytest

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/stagedrain/stagedrain/relay"
)

// DrainConfig is what Drain drains, and where to.
type DrainConfig struct {
	// DatabaseURL is the database of staged_jobs. Required.
	DatabaseURL string
	// Schema holds staged_jobs, migrated (relay.Migrate). Default "public".
	Schema string
	// Redis receives the jobs. Required; Drain does not close it.
	Redis redis.UniversalClient
	// RedisNamespace prefixes every key with RedisNamespace + ":", as
	// relay.Config.RedisNamespace does. Default "" (no prefix).
	RedisNamespace string
	// TimestampFormat is relay.Config.TimestampFormat. Default
	// relay.TimestampSeconds.
	TimestampFormat relay.TimestampFormat
	// Timeout bounds the whole drain; past it the test fails. Default 10s.
	Timeout time.Duration
}

// Drain runs a relay (relay.New and Run, the code stagedrain run runs) on
// cfg.Schema until staged_jobs holds no committed row, stops it, and returns
// how many jobs it pushed to Redis. Jobs with a run_at in the future are
// pushed too, to Sidekiq's schedule set, as the relay always does.
//
// The test fails, with the relay's warnings and errors, if the relay stops
// with an error (say the schema was never migrated), if the drain takes
// longer than cfg.Timeout, if rows stay staged (Redis out of memory, or
// another relay leading the schema: Drain's relay then waits as a standby),
// or if the relay moved a job to staged_jobs_dead (poison: Redis refused it
// with WRONGTYPE, its payload is too big, a column is NULL).
// Commit what the test staged before calling Drain: the relay sees only
// committed rows.
func Drain(ctx context.Context, t testing.TB, cfg DrainConfig) int {
	t.Helper()
	if cfg.Schema == "" {
		cfg.Schema = "public"
	}
	if cfg.Timeout == 0 {
		cfg.Timeout = 10 * time.Second
	}
	ctx, cancel := context.WithTimeout(ctx, cfg.Timeout)
	defer cancel()

	core, logs := observer.New(zapcore.DebugLevel)
	r, err := relay.New(relay.Config{
		DatabaseURL:     cfg.DatabaseURL,
		Redis:           cfg.Redis,
		Schema:          cfg.Schema,
		RedisNamespace:  cfg.RedisNamespace,
		TimestampFormat: cfg.TimestampFormat,
		MaxBackoff:      500 * time.Millisecond,
		Logger:          zap.New(core),
	})
	if err != nil {
		t.Fatalf("relaytest: Drain: %v", err)
	}
	conn, err := pgx.Connect(ctx, cfg.DatabaseURL)
	if err != nil {
		t.Fatalf("relaytest: Drain: connect: %v", err)
	}
	defer conn.Close(context.WithoutCancel(ctx))

	runCtx, stop := context.WithCancel(ctx)
	defer stop()
	done := make(chan error, 1)
	go func() { done <- r.Run(runCtx) }()

	// Every exit below stops the relay and waits for Run first, so that no
	// goroutine outlives Drain, and every log line is in.
	var runErr error
	stopped := false
	halt := func() {
		if !stopped {
			stop()
			runErr = <-done
			stopped = true
		}
	}
	defer halt()

	count := "SELECT count(*) FROM " + pgx.Identifier{cfg.Schema, "staged_jobs"}.Sanitize()
	tick := time.NewTicker(10 * time.Millisecond)
	defer tick.Stop()
	for {
		var left int
		qErr := conn.QueryRow(ctx, count).Scan(&left)
		if qErr == nil && left == 0 {
			break
		}
		select {
		case runErr = <-done:
			stopped = true
			t.Fatalf("relaytest: Drain: the relay stopped: %v; relay logs: %s", runErr, relayLogs(logs, zapcore.WarnLevel))
		case <-ctx.Done():
			halt()
			seen := fmt.Sprintf("%d rows staged", left)
			if qErr != nil {
				seen = "count staged rows: " + qErr.Error()
			}
			t.Fatalf("relaytest: Drain: %s still not drained after %s (%v); %s; relay logs: %s",
				pgx.Identifier{cfg.Schema, "staged_jobs"}.Sanitize(), cfg.Timeout, ctx.Err(), seen, relayLogs(logs, zapcore.InfoLevel))
		case <-tick.C:
		}
	}
	halt()
	if runErr != nil {
		t.Fatalf("relaytest: Drain: the relay stopped: %v; relay logs: %s", runErr, relayLogs(logs, zapcore.WarnLevel))
	}
	if dead := logs.FilterMessage("job dead-lettered"); dead.Len() > 0 {
		t.Fatalf("relaytest: Drain: %d jobs dead-lettered (moved to %s); relay logs: %s",
			dead.Len(), pgx.Identifier{cfg.Schema, "staged_jobs_dead"}.Sanitize(), relayLogs(logs, zapcore.WarnLevel))
	}
	drained := 0
	for _, e := range logs.FilterMessage("batch drained").All() {
		if n, ok := e.ContextMap()["count"].(int64); ok {
			drained += int(n)
		}
	}
	return drained
}

// relayLogs lists the relay's log lines at level or above, for a failure
// message: the last 30, each with its error.
func relayLogs(logs *observer.ObservedLogs, level zapcore.Level) string {
	var out []string
	for _, e := range logs.All() {
		if e.Level < level {
			continue
		}
		s := e.Level.String() + " " + e.Message
		if err, ok := e.ContextMap()["error"]; ok {
			s += fmt.Sprintf(" (%v)", err)
		}
		if reason, ok := e.ContextMap()["reason"]; ok {
			s += fmt.Sprintf(" (%v)", reason)
		}
		out = append(out, s)
	}
	if len(out) == 0 {
		return "none"
	}
	if len(out) > 30 {
		out = out[len(out)-30:]
	}
	return strings.Join(out, "; ")
}
