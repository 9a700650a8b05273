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

// loadRun is what one open-loop load recorded: times since base, in
// nanoseconds plus 1 (0: not yet), of job i's COMMIT returning and of its
// arrival in Redis.
type loadRun struct {
	base      time.Time
	span      time.Duration // from base to the writers' end
	committed []atomic.Int64
	arrived   []atomic.Int64
}

// window returns the sorted latencies of the jobs whose COMMIT returned
// within [from, to) after base, how many committed then, and how many of
// those never arrived.
func (l *loadRun) window(from, to time.Duration) (lats []time.Duration, commits, missing int64) {
	for i := range l.committed {
		c := l.committed[i].Load()
		if c == 0 || time.Duration(c-1) < from || time.Duration(c-1) >= to {
			continue
		}
		commits++
		a := l.arrived[i].Load()
		if a == 0 {
			missing++
			continue
		}
		lats = append(lats, max(0, time.Duration(a-c)))
	}
	slices.Sort(lats)
	return lats, commits, missing
}

// load offers rate jobs/s to queue, job i in tables[i % len(tables)], from
// writers connections, as the latency scenario does (open loop; latency is
// from COMMIT returning to arrival in Redis, which two consumers BRPOP),
// from base (zero: once the writers have connected) until d has passed or
// stop is closed, and, without stop, on until minCommits jobs have
// committed. Then it waits, up to 10s, for the committed jobs to arrive.
func (b *bench) load(ctx context.Context, p *relayProc, tables []string, rate, writers int, queue string, base time.Time, d time.Duration, stop <-chan struct{}) (*loadRun, error) {
	n := max(minCommits, int(float64(rate)*d.Seconds()))
	interval := time.Second / time.Duration(rate)
	key := b.queueKey(queue)
	conns := make([]*pgx.Conn, 0, writers)
	defer func() { closeAll(ctx, conns) }()
	for range writers {
		conn, err := b.connect(ctx)
		if err != nil {
			return nil, err
		}
		conns = append(conns, conn)
	}
	inserts := make([]string, len(tables))
	for i, t := range tables {
		inserts[i] = "INSERT INTO " + t + " (job_name, job_args, queue) VALUES ('BenchLatencyJob', jsonb_build_array($1::bigint), $2)"
	}
	// Connecting may take longer than a quick run's d on a busy machine:
	// the schedule starts after it.
	if base.IsZero() {
		base = time.Now()
	}
	minimum := minCommits
	if stop != nil {
		minimum = 0 // stopped on a signal: it counts what it has
	}
	l := &loadRun{base: base, committed: make([]atomic.Int64, n), arrived: make([]atomic.Int64, n)}
	var arrivals atomic.Int64
	record := func(payload string, at time.Duration) {
		id, ok := argID(payload)
		if !ok || id < 0 || id >= int64(n) {
			return
		}
		if l.arrived[id].CompareAndSwap(0, int64(at)+1) {
			arrivals.Add(1)
		}
	}
	done := make(chan struct{})
	var consumers errgroup.Group
	for range 2 {
		consumers.Go(func() error {
			for {
				select {
				case <-done:
					return nil
				default:
				}
				res, err := b.rdb.BRPop(ctx, 200*time.Millisecond, key).Result()
				if errors.Is(err, redis.Nil) {
					continue
				}
				if err != nil {
					return fmt.Errorf("BRPOP: %w", err)
				}
				record(res[1], time.Since(base))
				more, err := b.rdb.RPopCount(ctx, key, 1000).Result()
				if err != nil && !errors.Is(err, redis.Nil) {
					return fmt.Errorf("RPOP: %w", err)
				}
				at := time.Since(base)
				for _, m := range more {
					record(m, at)
				}
			}
		})
	}
	finish := func() error {
		close(done)
		return consumers.Wait()
	}
	end := base.Add(d)
	g, gctx := errgroup.WithContext(ctx)
	for w, conn := range conns {
		g.Go(func() error {
			for i := w; i < n && (time.Now().Before(end) || i < minimum); i += len(conns) {
				t := time.NewTimer(time.Until(base.Add(time.Duration(i) * interval)))
				select {
				case <-gctx.Done():
					t.Stop()
					return gctx.Err()
				case <-stop:
					t.Stop()
					return nil
				case <-t.C:
				}
				// Not prepared: a thousand tables would overflow the
				// statement cache. One round trip all the same.
				if _, err := conn.Exec(gctx, inserts[i%len(inserts)], pgx.QueryExecModeExec, int64(i), queue); err != nil {
					return fmt.Errorf("stage: %w", err)
				}
				l.committed[i].Store(int64(time.Since(base)) + 1)
			}
			return nil
		})
	}
	if err := g.Wait(); err != nil {
		_ = finish()
		return nil, err
	}
	l.span = time.Since(base) // past d only for the first minCommits
	var commits int64
	for i := range l.committed {
		if l.committed[i].Load() != 0 {
			commits++
		}
	}
	for wait := time.Now().Add(10 * time.Second); arrivals.Load() < commits && time.Now().Before(wait); {
		if sleepCtx(ctx, time.Millisecond) != nil {
			break
		}
	}
	if err := finish(); err != nil {
		return nil, err
	}
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	return l, p.exited()
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
	run, err := b.load(ctx, p, others, manyRate, manyWriters, "fair", base, time.Hour, stop)
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
		run, err := b.load(ctx, p, tables, manyRate, manyWriters, "scale", time.Time{}, dur, nil)
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
