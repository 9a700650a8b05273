package bench

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/redis/go-redis/v9"
	"golang.org/x/sync/errgroup"

	"github.com/stagedrain/stagedrain/relay"
)

// The many-schemas scenarios: one relay run with --schemas, as an app with a
// schema per tenant runs it (relay/fleet.go). Their schemas are scratch
// schemas of the scratch database, <schema>_<group><number>, migrated when
// first needed and dropped with the rest.

const (
	// fairSchemas is how many schemas the schemas scenario's relay drains:
	// one with the backlog, the others under a steady load.
	fairSchemas = 10
	// manyRate and manyWriters are the steady load of both scenarios:
	// jobs/s spread over the schemas, and the writers that offer them.
	manyRate    = 100
	manyWriters = 4
	// fairP99 is the schemas scenario's target: the p99 latency of the
	// other schemas' jobs while one schema drains its backlog.
	fairP99 = 50 * time.Millisecond
)

// tenantSchemas names n scratch schemas of a group: "f" for the schemas
// scenario, "s" for scale.
func (b *bench) tenantSchemas(group string, n int) []string {
	out := make([]string, n)
	for i := range out {
		out[i] = fmt.Sprintf("%s_%s%04d", b.schema, group, i)
	}
	return out
}

// tenantPattern is the --schemas pattern of a group's schemas.
func (b *bench) tenantPattern(group string) string { return b.schema + "_" + group + "*" }

// tenantTables returns the quoted staged_jobs of each schema.
func (b *bench) tenantTables(schemas []string) []string {
	out := make([]string, len(schemas))
	for i, s := range schemas {
		out[i] = pgx.Identifier{s, "staged_jobs"}.Sanitize()
	}
	return out
}

// migrateTenants creates and migrates those of schemas that this run has
// not migrated yet, on four connections.
func (b *bench) migrateTenants(ctx context.Context, schemas []string) error {
	var todo []string
	for _, s := range schemas {
		if !slices.Contains(b.tenants, s) {
			todo = append(todo, s)
		}
	}
	if len(todo) == 0 {
		return nil
	}
	// Recorded before: cleanup drops them IF EXISTS.
	b.tenants = append(b.tenants, todo...)
	b.progress("migrating %d scratch schemas ...", len(todo))
	var next atomic.Int64
	g, gctx := errgroup.WithContext(ctx)
	for range min(4, len(todo)) {
		g.Go(func() error {
			conn, err := b.connect(gctx)
			if err != nil {
				return err
			}
			defer conn.Close(context.WithoutCancel(gctx))
			for {
				i := int(next.Add(1) - 1)
				if i >= len(todo) {
					return nil
				}
				if _, err := relay.Migrate(gctx, conn, todo[i]); err != nil {
					return fmt.Errorf("migrate %s: %w", todo[i], err)
				}
			}
		})
	}
	return g.Wait()
}

// relaySessions counts the sessions of database that the relay of pid
// holds: its sessions are named "stagedrain <role> <host>:<pid>".
func relaySessions(ctx context.Context, admin *pgx.Conn, database string, pid int) (int, error) {
	var n int
	err := admin.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity
		WHERE datname = $1 AND application_name LIKE 'stagedrain%' AND right(application_name, length($2)) = $2`,
		database, ":"+strconv.Itoa(pid)).Scan(&n)
	if err != nil {
		return 0, fmt.Errorf("read pg_stat_activity: %w", err)
	}
	return n, nil
}

// probeAll stages one probe job in each of tables, in one transaction, and
// waits until the relay has delivered them all: it leads every schema.
func (b *bench) probeAll(ctx context.Context, p *relayProc, tables []string) error {
	conn, err := b.connect(ctx)
	if err != nil {
		return err
	}
	defer conn.Close(context.WithoutCancel(ctx))
	var sql strings.Builder
	for i, t := range tables {
		fmt.Fprintf(&sql, "INSERT INTO %s (job_name, job_args, queue) VALUES ('BenchProbeJob', jsonb_build_array(%d), 'bench_probe');", t, i)
	}
	// One simple query: one round trip, one transaction.
	if _, err := conn.PgConn().Exec(ctx, sql.String()).ReadAll(); err != nil {
		return fmt.Errorf("stage probe jobs: %w", err)
	}
	key := b.queueKey("bench_probe")
	// A relay leads its schemas one after another, each after checks on
	// the lock connection that take longer the more schemas the database
	// has.
	timeout := 30*time.Second + time.Duration(len(tables))*250*time.Millisecond
	deadline := time.Now().Add(timeout)
	seen := make([]bool, len(tables))
	for left := len(tables); left > 0; {
		if err := p.exited(); err != nil {
			return err
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("the relay delivered %d of %d probe jobs, one per schema, in %s", len(tables)-left, len(tables), timeout)
		}
		res, err := b.rdb.BRPop(ctx, 500*time.Millisecond, key).Result()
		if errors.Is(err, redis.Nil) {
			continue
		}
		if err != nil {
			return fmt.Errorf("BRPOP probe: %w", err)
		}
		more, err := b.rdb.RPopCount(ctx, key, 1000).Result()
		if err != nil && !errors.Is(err, redis.Nil) {
			return fmt.Errorf("RPOP probe: %w", err)
		}
		for _, m := range append(more, res[1]) {
			if id, ok := argID(m); ok && id >= 0 && id < int64(len(seen)) && !seen[id] {
				seen[id] = true
				left--
			}
		}
	}
	return nil
}

// clampNote is what a row of idle statements adds when idleStatements
// clamped the figure to 0.
func clampNote(clamped bool, short, long idleRun) string {
	if !clamped {
		return ""
	}
	return fmt.Sprintf("; the shorter run counted %d more (start-up or shutdown varied): 0 shown", short.whole.xacts-long.whole.xacts)
}

// latencyCells fills a row's p50, p99 and max from sorted latencies.
func latencyCells(row *benchRow, lats []time.Duration) {
	if len(lats) > 0 {
		row.p50, row.p99, row.max = fmtDuration(percentile(lats, 0.50)), fmtDuration(percentile(lats, 0.99)), fmtDuration(lats[len(lats)-1])
	}
}

// benchSchemas is fairness: one relay drains fairSchemas schemas (--schemas
// with a pattern), one of which gets a backlog of --backlog jobs, committed
// at once, while the others get manyRate jobs/s. Their latency is measured
// over the jobs committed from the backlog's COMMIT to its last job's
// arrival in Redis.
func (b *bench) benchSchemas(ctx context.Context) error {
	schemas := b.tenantSchemas("f", fairSchemas)
	if err := b.migrateTenants(ctx, schemas); err != nil {
		return err
	}
	tables := b.tenantTables(schemas)
	hot, others := tables[0], tables[1:]
	conn, err := b.connect(ctx)
	if err != nil {
		return err
	}
	defer conn.Close(context.WithoutCancel(ctx))
	if err := b.resetTables(ctx, conn, tables); err != nil {
		return err
	}
	p, err := b.startRelayOn(false, "--schemas", b.tenantPattern("f"))
	if err != nil {
		return err
	}
	if err := b.probeAll(ctx, p, tables); err != nil {
		return err
	}
	if err := b.waitReadyOn(ctx, p, true, others); err != nil {
		return err
	}
	total := int64(b.cfg.Backlog)
	hotKey := b.queueKey("hot")
	label := fmt.Sprintf("schemas: %d schemas' latency while 1 drains its backlog", len(others))
	b.progress("%s: %d jobs/s over %d schemas, then the backlog committed in %s ...", label, manyRate, len(others), schemas[0])

	// The backlog, 1s into the load: staged and ANALYZEd (as autovacuum
	// would) in one transaction, then watched (LLEN every 5ms) until it is
	// all in Redis.
	var committedAt, drainedAt time.Duration
	stop := make(chan struct{})
	base := time.Now()
	var backlog errgroup.Group
	backlog.Go(func() error {
		defer close(stop)
		if err := sleepCtx(ctx, time.Second); err != nil {
			return err
		}
		err := pgx.BeginFunc(ctx, conn, func(tx pgx.Tx) error {
			if _, err := tx.Exec(ctx, "INSERT INTO "+hot+" (job_name, job_args, queue)"+
				" SELECT 'BenchBacklogJob', jsonb_build_array(g), 'hot' FROM generate_series(1, $1::bigint) g", total); err != nil {
				return err
			}
			_, err := tx.Exec(ctx, "ANALYZE "+hot)
			return err
		})
		if err != nil {
			return fmt.Errorf("stage the backlog: %w", err)
		}
		committedAt = time.Since(base)
		b.progress("%s: backlog committed %s into the load; draining ...", label, committedAt.Round(time.Millisecond))
		deadline := time.Now().Add(time.Minute + time.Duration(total)*50*time.Microsecond)
		for last := time.Now(); ; {
			n, err := b.rdb.LLen(ctx, hotKey).Result()
			if err != nil {
				return fmt.Errorf("LLEN: %w", err)
			}
			if n >= total {
				drainedAt = time.Since(base)
				return nil
			}
			if err := p.exited(); err != nil {
				return err
			}
			if time.Now().After(deadline) {
				return fmt.Errorf("%s of %s backlog jobs in Redis after %s", fmtInt(n), fmtInt(total), (time.Since(base) - committedAt).Round(time.Second))
			}
			if time.Since(last) >= time.Second {
				b.progress("%s: %s of %s in Redis", label, fmtInt(n), fmtInt(total))
				last = time.Now()
			}
			if err := sleepCtx(ctx, 5*time.Millisecond); err != nil {
				return err
			}
		}
	})
	run, err := b.load(ctx, p, loadSpec{tables: others, rate: manyRate, writers: manyWriters, queue: "fair", base: base, d: time.Hour, stop: stop})
	if berr := backlog.Wait(); berr != nil {
		return berr
	}
	if err != nil {
		return err
	}
	rss, err := b.stopRelay()
	if err != nil {
		return err
	}
	drain := drainedAt - committedAt
	lats, commits, missing := run.window(committedAt, drainedAt)
	row := benchRow{scenario: label, offered: fmtInt(manyRate), achieved: fmtRate(float64(commits) / drain.Seconds()),
		target: "p99 <= " + fairP99.String()}
	latencyCells(&row, lats)
	ok := missing == 0 && len(lats) > 0 && percentile(lats, 0.99) <= fairP99
	row.result = b.verdict(ok)
	row.note = fmt.Sprintf("one relay --schemas of %d schemas, one with a backlog of %s jobs; %d writers over the %d others; %s jobs committed from the backlog's COMMIT to its last job in Redis (%s)",
		fairSchemas, fmtInt(total), manyWriters, len(others), fmtInt(commits), drain.Round(time.Millisecond))
	if commits == 0 {
		// A small backlog (--quick) on a fast machine drains between two
		// of the others' commits.
		row.result = "not judged (no job in the window)"
	}
	if missing > 0 {
		row.note += fmt.Sprintf("; %s committed jobs never arrived (10s wait)", fmtInt(missing))
	}
	b.progress("%s: p50 %s, p99 %s, max %s over %s jobs", label, row.p50, row.p99, row.max, fmtInt(commits))
	rate := float64(total) / max(drain, time.Millisecond).Seconds()
	b.rows = append(b.rows, row,
		benchRow{scenario: "schemas: the backlog of 1 schema", offered: "backlog",
			achieved: fmtRate(rate),
			note:     fmt.Sprintf("%s jobs, from their COMMIT to the last in Redis, beside the others' load; relay peak RSS %s", fmtInt(total), fmtBytes(rss))},
	)
	return nil
}

// benchScale measures one relay --schemas of 1, 10, 100 and 1,000 schemas
// (a pattern): for each, two idle runs give the connections it holds and
// the statements a second it sends (as the idle scenario counts them, but
// over the time from leading every schema to SIGTERM: leading 1,000 takes
// a minute, give or take seconds), and a third the time it takes to lead
// every schema, its latency at manyRate jobs/s spread over the schemas and
// its peak RSS.
func (b *bench) benchScale(ctx context.Context) error {
	admin, err := pgx.Connect(ctx, b.baseURL)
	if err != nil {
		return fmt.Errorf("connect: %w", err)
	}
	defer admin.Close(context.WithoutCancel(ctx))
	warm, window := b.cfg.ScaleWarmup, b.cfg.ScaleWindow
	for _, n := range b.cfg.ScaleSteps {
		// Ascending sizes: the pattern matches exactly the first n.
		schemas := b.tenantSchemas("s", n)
		if err := b.migrateTenants(ctx, schemas); err != nil {
			return err
		}
		args := []string{"--schemas", b.tenantPattern("s")}
		name := "scale, 1 schema"
		if n != 1 {
			name = fmt.Sprintf("scale, %s schemas", fmtInt(int64(n)))
		}
		b.progress("%s: a relay run idle for %s, then one idle for %s more ...", name, warm, window)
		short, err := b.runIdleOn(ctx, admin, warm, 0, schemas, args, true)
		if err != nil {
			return err
		}
		long, err := b.runIdleOn(ctx, admin, warm+window, 0, schemas, args, true)
		if err != nil {
			return err
		}
		idleSessions := long.sessions
		stmts, _, clamped, err := idleStatements(short, long)
		if err != nil {
			return err
		}

		tables := b.tenantTables(schemas)
		conn, err := b.connect(ctx)
		if err != nil {
			return err
		}
		err = b.resetTables(ctx, conn, tables)
		conn.Close(context.WithoutCancel(ctx))
		if err != nil {
			return err
		}
		p, err := b.startRelayOn(false, args...)
		if err != nil {
			return err
		}
		started := time.Now()
		if err := b.probeAll(ctx, p, tables); err != nil {
			return err
		}
		ready := time.Since(started)
		if err := b.waitReadyOn(ctx, p, true, tables); err != nil {
			return err
		}
		dur := b.cfg.LatencyDuration
		b.progress("%s: %d jobs/s spread over them, %s ...", name, manyRate, dur)
		run, err := b.load(ctx, p, loadSpec{tables: tables, rate: manyRate, writers: manyWriters, queue: "scale", d: dur})
		if err != nil {
			return err
		}
		loadSessions, err := relaySessions(ctx, admin, b.database, p.cmd.Process.Pid)
		if err != nil {
			return err
		}
		rss, err := b.stopRelay()
		if err != nil {
			return err
		}
		lats, commits, missing := run.window(0, time.Duration(1<<62))
		lat := benchRow{scenario: name + ": latency at " + strconv.Itoa(manyRate) + " jobs/s", offered: fmtInt(manyRate),
			achieved: fmtRate(float64(commits) / run.span.Seconds()),
			note:     fmt.Sprintf("spread round robin over the schemas by %d writers; %s jobs committed in %s", manyWriters, fmtInt(commits), run.span.Round(time.Millisecond))}
		if missing > 0 {
			lat.note += fmt.Sprintf("; %s committed jobs never arrived (10s wait)", fmtInt(missing))
		}
		latencyCells(&lat, lats)
		b.progress("%s: %d sessions idle, %d under load; %.2f statements/s idle; peak RSS %s; every schema led in %s; p50 %s, p99 %s, max %s",
			name, idleSessions, loadSessions, stmts, fmtBytes(rss), ready.Round(time.Millisecond), lat.p50, lat.p99, lat.max)
		b.rows = append(b.rows,
			benchRow{scenario: name + ": connections held", achieved: strconv.Itoa(idleSessions),
				note: fmt.Sprintf("pg_stat_activity rows of the relay's pid at the end of its idle run; %d at the end of its load run", loadSessions)},
			benchRow{scenario: name + ": idle statements", offered: "0", achieved: fmt.Sprintf("%.2f/s", stmts),
				note: fmt.Sprintf("pg_stat_database of %s, as the idle scenario counts: two runs idle %s and %s after leading every schema, the difference%s", b.database, warm, warm+window, clampNote(clamped, short, long))},
			benchRow{scenario: name + ": relay peak RSS", achieved: fmtBytes(rss), note: "VmHWM of the load run"},
			benchRow{scenario: name + ": time to lead every schema", achieved: strconv.FormatFloat(ready.Seconds(), 'f', 2, 64) + "s",
				note: "from the relay's start to the delivery of a probe job committed in each schema before it"},
			lat,
		)
	}
	return nil
}
