package bench

import (
	"context"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
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

// The scenarios of bench. Each starts from an empty staged_jobs and an
// empty namespace, starts its own relay and stops it with SIGTERM.

// benchTPS measures the app's write throughput: writers commit one staged
// job per transaction, as fast as they can, (a) with no relay and the
// table's triggers disabled, (b) with a polling relay and the triggers
// disabled, (c) with the relay and its trigger, as users run it.
func (b *bench) benchTPS(ctx context.Context) error {
	conn, err := b.connect(ctx)
	if err != nil {
		return err
	}
	defer conn.Close(context.WithoutCancel(ctx))
	triggers := func(on bool) error { return setTriggers(ctx, conn, []string{b.table()}, on) }

	pollingLabel := "app TPS, polling relay, triggers disabled"
	if b.pollOnly {
		pollingLabel += ", --poll-only"
	}
	// The three setups take turns, in rounds, each running its share of
	// the duration per round: this machine's own drift (other load, disk,
	// autovacuum) then falls on all three alike instead of on one, and
	// the ratios compare like with like. Each round starts with the next
	// setup, so that none always follows the same one.
	const rounds = 3
	slice := b.cfg.TPSDuration / time.Duration(rounds)
	var noRelay, polling, withTrigger float64
	setups := []struct {
		trigger bool     // the table's triggers enabled
		sum     *float64 // the mean TPS over the rounds
		measure func() (float64, error)
	}{
		{false, &noRelay, func() (float64, error) {
			return b.appTPS(ctx, "app TPS, no relay, triggers disabled", slice)
		}},
		{false, &polling, func() (float64, error) { return b.tpsWithRelay(ctx, pollingLabel, true, slice) }},
		{true, &withTrigger, func() (float64, error) {
			return b.tpsWithRelay(ctx, "app TPS, relay and trigger", false, slice)
		}},
	}
	for round := range rounds {
		b.progress("app TPS: round %d of %d", round+1, rounds)
		for i := range setups {
			s := setups[(round+i)%len(setups)]
			if err := b.reset(ctx, conn); err != nil {
				return err
			}
			if err := triggers(s.trigger); err != nil {
				return err
			}
			tps, err := s.measure()
			if err != nil {
				return err
			}
			*s.sum += tps / rounds
		}
	}
	// The scenarios after this one run the relay as users do: with its
	// trigger.
	if err := triggers(true); err != nil {
		return err
	}

	w := strconv.Itoa(b.cfg.Writers)
	ofPolling, ofNone := withTrigger/polling, withTrigger/noRelay
	b.rows = append(b.rows,
		benchRow{scenario: "app TPS, no relay, triggers disabled", offered: "closed loop", achieved: fmtRate(noRelay),
			note: fmt.Sprintf("%s writers, one job per transaction, %s in %d turns, rotating with the two below", w, b.cfg.TPSDuration, rounds)},
		benchRow{scenario: pollingLabel, offered: "closed loop", achieved: fmtRate(polling),
			note: fmt.Sprintf("%.0f%% of no relay", 100*polling/noRelay)},
		benchRow{scenario: "app TPS, relay and trigger", offered: "closed loop", achieved: fmtRate(withTrigger),
			target: ">= 90% of polling, >= 75% of no relay", result: b.verdict(ofPolling >= 0.9 && ofNone >= 0.75),
			note: fmt.Sprintf("%.0f%% of polling, %.0f%% of no relay", 100*ofPolling, 100*ofNone)},
	)
	return nil
}

// setTriggers enables (on) or disables the user triggers of tables
// (quoted): stagedrain_wake, the only one a migrated staged_jobs has. One
// round trip, one transaction.
func setTriggers(ctx context.Context, conn *pgx.Conn, tables []string, on bool) error {
	verb := "DISABLE"
	if on {
		verb = "ENABLE"
	}
	var sql strings.Builder
	for _, t := range tables {
		fmt.Fprintf(&sql, "ALTER TABLE %s %s TRIGGER USER;", t, verb)
	}
	if _, err := conn.PgConn().Exec(ctx, sql.String()).ReadAll(); err != nil {
		return fmt.Errorf("%s triggers: %w", strings.ToLower(verb), err)
	}
	return nil
}

// tpsWithRelay runs appTPS while a relay drains.
func (b *bench) tpsWithRelay(ctx context.Context, label string, pollOnly bool, d time.Duration) (float64, error) {
	p, err := b.startRelay(pollOnly)
	if err != nil {
		return 0, err
	}
	if err := b.waitReady(ctx, p, !pollOnly); err != nil {
		return 0, err
	}
	tps, err := b.appTPS(ctx, label, d)
	if err != nil {
		return 0, err
	}
	if err := p.exited(); err != nil {
		return 0, err
	}
	_, err = b.stopRelay()
	return tps, err
}

// minCommits is the fewest commits a timed scenario counts: it goes on past
// its duration until it has them, so that a short run (--quick) on a busy
// machine, whose writers may not get a commit in at all within 500ms,
// still measures something. Its rate is then over the time it really took.
const minCommits = 50

// appTPS runs the writers in a closed loop for d (and on, until they have
// committed minCommits in all) and returns the commits per second. Each
// transaction is one INSERT statement (autocommit), as pgbench runs a
// one-statement script.
func (b *bench) appTPS(ctx context.Context, label string, d time.Duration) (float64, error) {
	tps, _, err := b.appTPSOn(ctx, label, d, []string{b.table()})
	return tps, err
}

// appTPSOn is appTPS with each transaction's row in one of tables (quoted),
// picked at random; it returns the commits too.
func (b *bench) appTPSOn(ctx context.Context, label string, d time.Duration, tables []string) (float64, int64, error) {
	tps, commits, err := b.appTPSGroups(ctx, label, d, writerGroup{tables: tables, writers: b.cfg.Writers})
	if err != nil {
		return 0, 0, err
	}
	return tps[0], commits[0], nil
}

// writerGroup is a set of writers, each transaction staging one row in
// one of tables (quoted), picked at random, in queue ("": the column's
// default).
type writerGroup struct {
	tables  []string
	queue   string
	writers int
}

// appTPSGroups is appTPS of several groups of writers at the same time:
// all start together and stop together, after d and once every group has
// minCommits. It returns each group's commits per second and commits.
func (b *bench) appTPSGroups(ctx context.Context, label string, d time.Duration, groups ...writerGroup) ([]float64, []int64, error) {
	type writer struct {
		conn    *pgx.Conn
		inserts []string
		queue   string
		total   *atomic.Int64
	}
	var writers []writer
	defer func() {
		for _, w := range writers {
			w.conn.Close(context.WithoutCancel(ctx))
		}
	}()
	totals := make([]atomic.Int64, len(groups))
	for i, g := range groups {
		inserts := make([]string, len(g.tables))
		for j, t := range g.tables {
			inserts[j] = "INSERT INTO " + t + " (job_name, job_args) VALUES ('BenchTPSJob', jsonb_build_array($1::bigint))"
			if g.queue != "" {
				inserts[j] = "INSERT INTO " + t + " (job_name, job_args, queue) VALUES ('BenchTPSJob', jsonb_build_array($1::bigint), $2)"
			}
		}
		conns, err := b.writerConns(ctx, g.writers, inserts...)
		if err != nil {
			return nil, nil, err
		}
		for _, c := range conns {
			writers = append(writers, writer{conn: c, inserts: inserts, queue: g.queue, total: &totals[i]})
		}
	}
	b.progress("%s: %d writers, %s ...", label, len(writers), d)
	enough := func() bool {
		for i := range totals {
			if totals[i].Load() < minCommits {
				return false
			}
		}
		return true
	}
	start := time.Now()
	end := start.Add(d)
	g, gctx := errgroup.WithContext(ctx)
	for _, w := range writers {
		g.Go(func() error {
			args := []any{int64(0)}
			if w.queue != "" {
				args = append(args, w.queue)
			}
			for n := int64(0); time.Now().Before(end) || !enough(); n++ {
				insert := w.inserts[0]
				if len(w.inserts) > 1 {
					insert = w.inserts[rand.IntN(len(w.inserts))]
				}
				args[0] = n
				if _, err := w.conn.Exec(gctx, insert, args...); err != nil {
					return fmt.Errorf("stage: %w", err)
				}
				w.total.Add(1)
			}
			return nil
		})
	}
	if err := g.Wait(); err != nil {
		return nil, nil, err
	}
	// Every writer's last commit returned by now: the rates are over the
	// time they all took, d or more.
	took := time.Since(start)
	tps := make([]float64, len(groups))
	commits := make([]int64, len(groups))
	for i := range groups {
		commits[i] = totals[i].Load()
		tps[i] = float64(commits[i]) / took.Seconds()
		name := label
		if len(groups) > 1 {
			name = fmt.Sprintf("%s, group %d", label, i+1)
		}
		b.progress("%s: %.0f TPS (%d commits in %s)", name, tps[i], commits[i], took.Round(time.Millisecond))
	}
	return tps, commits, nil
}

// writerConns opens n connections to the scratch database, each with every
// statement of sqls prepared so that no round trip of the timed loop
// prepares one.
func (b *bench) writerConns(ctx context.Context, n int, sqls ...string) ([]*pgx.Conn, error) {
	conns := make([]*pgx.Conn, 0, n)
	for range n {
		conn, err := b.connect(ctx)
		if err != nil {
			closeAll(ctx, conns)
			return nil, err
		}
		conns = append(conns, conn)
		for _, sql := range sqls {
			if _, err := conn.Prepare(ctx, sql, sql); err != nil {
				closeAll(ctx, conns)
				return nil, fmt.Errorf("prepare: %w", err)
			}
		}
	}
	return conns, nil
}

// warmWriters has each writer run each of inserts once, in a transaction
// it rolls back: nothing is staged, nothing notifies. A session's first
// INSERT into a table loads the table's, its indexes' and its trigger's
// caches and plans the statement, a millisecond or so each: over 200
// schemas the writers' first second ran behind schedule, then caught up
// at twice the offered rate, and that burst, not the offered rate, made
// half the jobs over 5ms in a fleet's latency run. An app's pooled
// sessions are warm; the latency scenarios measure against such writers.
func warmWriters(ctx context.Context, conns []*pgx.Conn, inserts []string, queue string) error {
	g, gctx := errgroup.WithContext(ctx)
	for _, conn := range conns {
		g.Go(func() error {
			tx, err := conn.Begin(gctx)
			if err != nil {
				return fmt.Errorf("warm the writers: %w", err)
			}
			defer tx.Rollback(context.WithoutCancel(gctx)) //nolint:errcheck // rolled back on purpose; the error is the connection's
			for _, sql := range inserts {
				if _, err := tx.Exec(gctx, sql, int64(-1), queue); err != nil {
					return fmt.Errorf("warm the writers: %w", err)
				}
			}
			return nil
		})
	}
	return g.Wait()
}

func closeAll(ctx context.Context, conns []*pgx.Conn) {
	for _, c := range conns {
		c.Close(context.WithoutCancel(ctx))
	}
}

// waitReady waits until the relay delivers a probe job; with fast, until
// it delivers three in a row each within fastProbe of its commit, so that
// its wake-up, not the fallback poll (1s), is what delivers them.
func (b *bench) waitReady(ctx context.Context, p *relayProc, fast bool) error {
	return b.waitReadyOn(ctx, p, fast, []string{b.table()})
}

// waitReadyOn is waitReady for a relay of the tables (quoted): probe job i
// goes to tables[i % len(tables)]. With more than one table, the relay
// first delivers one probe job staged in each.
func (b *bench) waitReadyOn(ctx context.Context, p *relayProc, fast bool, tables []string) error {
	conn, err := b.connect(ctx)
	if err != nil {
		return err
	}
	defer conn.Close(context.WithoutCancel(ctx))
	const timeout = 60 * time.Second
	key := b.queueKey("bench_probe")
	insert := func(table string) string {
		return "INSERT INTO " + table + " (job_name, job_args, queue) VALUES ('BenchProbeJob', jsonb_build_array($1::bigint), 'bench_probe')"
	}
	want := 1
	if fast {
		want = 3
	}
	deadline := time.Now().Add(timeout)
	// next waits up to 500ms for a probe job and returns its id (-1 for
	// none, or one it cannot read), or an error: the relay exited, or
	// the deadline passed (late says how far it got).
	next := func(late func() string) (int64, error) {
		if err := p.exited(); err != nil {
			return -1, err
		}
		if time.Now().After(deadline) {
			return -1, errors.New(late())
		}
		res, err := b.rdb.BRPop(ctx, 500*time.Millisecond, key).Result()
		if errors.Is(err, redis.Nil) {
			return -1, nil
		}
		if err != nil {
			return -1, fmt.Errorf("BRPOP probe: %w", err)
		}
		if got, ok := argID(res[1]); ok {
			return got, nil
		}
		return -1, nil
	}
	// A relay of many tables first delivers a probe from each, so that
	// its first drain of each schema (which prepares that schema's
	// statements) comes before the measured runs, not in the first.
	warm := int64(0)
	if len(tables) > 1 {
		warm = int64(len(tables))
		for id := range warm {
			if _, err := conn.Exec(ctx, insert(tables[id]), id); err != nil {
				return fmt.Errorf("stage a probe job: %w", err)
			}
		}
		for seen := int64(0); seen < warm; {
			got, err := next(func() string {
				return fmt.Sprintf("the relay delivered %d of %d probe jobs, one staged in each of its tables, in %s", seen, warm, timeout)
			})
			if err != nil {
				return err
			}
			if got >= 0 && got < warm {
				seen++
			}
		}
	}
	for id, streak := warm, 0; streak < want; id++ {
		if _, err := conn.Exec(ctx, insert(tables[int(id)%len(tables)]), id); err != nil {
			return fmt.Errorf("stage a probe job: %w", err)
		}
		committed := time.Now()
		for delivered := false; !delivered; {
			got, err := next(func() string {
				return fmt.Sprintf("the relay did not deliver %d probe jobs in a row, each within %s, in %s", want, fastProbe, timeout)
			})
			if err != nil {
				return err
			}
			delivered = got == id
		}
		if !fast || time.Since(committed) <= fastProbe {
			streak++
		} else {
			streak = 0
		}
	}
	return nil
}

// fastProbe is how soon a probe job must arrive to show the relay woken by
// its commit: well under the fallback poll's 0.75-1.25s, and loose enough
// for a busy machine, where a wake-up may wait for a core.
const fastProbe = 250 * time.Millisecond

// argID reads the id of a bench job from its Sidekiq payload: the first
// element of "args".
func argID(payload string) (int64, bool) {
	_, rest, ok := strings.Cut(payload, `"args":[`)
	if !ok {
		return 0, false
	}
	end := strings.IndexFunc(rest, func(r rune) bool { return r < '0' || r > '9' })
	if end <= 0 {
		return 0, false
	}
	id, err := strconv.ParseInt(rest[:end], 10, 64)
	return id, err == nil
}

// latencyCase is one rate of the latency scenario.
type latencyCase struct {
	rate, writers int
	p50, p99      time.Duration // targets; 0 means none
	// tables, if set, are the tables of a fleet's schemas: job i is
	// staged in tables[i % len(tables)]. Otherwise the scratch table.
	tables []string
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

// loadSpec is an open-loop load: rate jobs/s offered to queue, job i staged
// in tables[i % len(tables)] (quoted), by writers connections, from base
// (zero: once the writers have connected) until d has passed or stop is
// closed.
type loadSpec struct {
	tables        []string
	rate, writers int
	queue         string
	base          time.Time
	d             time.Duration
	stop          <-chan struct{}
	// prepare: each writer prepares every table's INSERT first. Not for
	// a thousand tables: they would overflow the statement cache.
	// Unprepared, an INSERT is one round trip all the same.
	prepare bool
}

// load runs an open-loop load: writers commit job i at base + i/rate (a
// writer that falls behind commits its next job at once; one so far behind
// that its next job would start after the end stops there: those jobs
// count as offered, not committed) and record when each COMMIT returned;
// two consumers in this process BRPOP the queue and record when each job
// arrived, on the same monotonic clock. A job that arrives before its
// writer saw the COMMIT return counts as 0. Without stop, the load goes on
// past d until minCommits jobs have committed (late), so that a short run
// on a busy machine has figures. Then it waits, up to 10s, for the
// committed jobs to arrive.
//
// The arrival time is when the consumer's BRPOP (or its RPOP of the jobs
// that arrived with it) returned, so each latency includes one loopback
// round trip to Redis (about 0.1ms) and, for a job that lands while its
// consumer handles the previous reply, that handling (microseconds).
func (b *bench) load(ctx context.Context, p *relayProc, s loadSpec) (*loadRun, error) {
	tables, rate, writers, queue, base, d, stop := s.tables, s.rate, s.writers, s.queue, s.base, s.d, s.stop
	n := max(minCommits, int(float64(rate)*d.Seconds()))
	interval := time.Second / time.Duration(rate)
	key := b.queueKey(queue)
	inserts := make([]string, len(tables))
	for i, t := range tables {
		inserts[i] = "INSERT INTO " + t + " (job_name, job_args, queue) VALUES ('BenchLatencyJob', jsonb_build_array($1::bigint), $2)"
	}
	var prepared []string
	if s.prepare {
		prepared = inserts
	}
	conns, err := b.writerConns(ctx, writers, prepared...)
	if err != nil {
		return nil, err
	}
	defer closeAll(ctx, conns)
	if s.prepare {
		if err := warmWriters(ctx, conns, inserts, queue); err != nil {
			return nil, err
		}
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
	finish := b.consume(ctx, key, base, record)
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
				// A statement the writer prepared runs as such; any other
				// is not prepared (QueryExecModeExec), in one round trip.
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

// freshRelay empties the scratch table and Redis keys, then starts the
// relay with its trigger and waits until it is ready.
func (b *bench) freshRelay(ctx context.Context) (*relayProc, error) {
	conn, err := b.connect(ctx)
	if err != nil {
		return nil, err
	}
	err = b.reset(ctx, conn)
	conn.Close(context.WithoutCancel(ctx))
	if err != nil {
		return nil, err
	}
	p, err := b.startRelay(false)
	if err != nil {
		return nil, err
	}
	if err := b.waitReady(ctx, p, true); err != nil {
		return nil, err
	}
	return p, nil
}

// benchLatency measures, at fixed offered rates, the time from COMMIT
// returning in the app to the job being visible in Redis.
func (b *bench) benchLatency(ctx context.Context) error {
	p, err := b.freshRelay(ctx)
	if err != nil {
		return err
	}
	for _, c := range []latencyCase{
		{rate: 100, writers: 4, p50: time.Millisecond, p99: 5 * time.Millisecond},
		{rate: 1000, writers: 4, p50: time.Millisecond, p99: 5 * time.Millisecond},
		{rate: 5000, writers: b.cfg.Writers, p99: 10 * time.Millisecond},
	} {
		row, err := b.latency(ctx, p, c)
		if err != nil {
			return err
		}
		b.rows = append(b.rows, row)
	}
	_, err = b.stopRelay()
	return err
}

// latency runs one latency case: c.rate jobs/s offered for --duration as
// load offers them, each writer's INSERTs prepared, and a row of the
// latencies of every job committed, against the case's targets.
func (b *bench) latency(ctx context.Context, p *relayProc, c latencyCase) (benchRow, error) {
	d := b.cfg.LatencyDuration
	queue := "latency" + strconv.Itoa(c.rate)
	label := fmt.Sprintf("latency, %s jobs/s offered by %d writers", fmtInt(int64(c.rate)), c.writers)
	tables := c.tables
	if len(tables) == 0 {
		tables = []string{b.table()}
	} else {
		label += fmt.Sprintf(" over %s schemas", fmtInt(int64(len(tables))))
	}
	b.progress("%s: %s ...", label, d)
	cpu0, err := p.cpu()
	if err != nil {
		return benchRow{}, err
	}
	run, err := b.load(ctx, p, loadSpec{tables: tables, rate: c.rate, writers: c.writers, queue: queue, d: d, prepare: true})
	if err != nil {
		return benchRow{}, err
	}
	cpu1, err := p.cpu()
	if err != nil {
		return benchRow{}, err
	}
	n := len(run.committed)
	span := max(d, run.span) // past d only for the first minCommits
	lats, commits, missing := run.window(0, time.Duration(1<<62))
	achieved := float64(commits) / span.Seconds()
	row := benchRow{scenario: label, offered: fmtInt(int64(c.rate)), achieved: fmtRate(achieved)}
	note := fmt.Sprintf("%s of %s jobs committed in %s", fmtInt(commits), fmtInt(int64(n)), span.Round(time.Millisecond))
	if missing > 0 {
		note += fmt.Sprintf("; %s committed jobs never arrived (10s wait)", fmtInt(missing))
	}
	// The relay's CPU at a rate the app does not set: two binaries'
	// figures of one sitting compare (issue 23; a closed loop's do not,
	// as the relay's batches grow with the app's rate).
	if arrived := commits - missing; arrived > 0 {
		note += fmt.Sprintf("; relay CPU %.1f ms per 1,000 jobs", float64(cpu1-cpu0)/float64(time.Millisecond)*1000/float64(arrived))
	}
	row.note = note
	var targets []string
	ok := missing == 0 && commits == int64(n)
	if len(lats) > 0 {
		p50, p99, worst := percentile(lats, 0.50), percentile(lats, 0.99), lats[len(lats)-1]
		row.p50, row.p99, row.max = fmtDuration(p50), fmtDuration(p99), fmtDuration(worst)
		if c.p50 > 0 {
			targets = append(targets, "p50 <= "+c.p50.String())
			ok = ok && p50 <= c.p50
		}
		targets = append(targets, "p99 <= "+c.p99.String())
		ok = ok && p99 <= c.p99
		b.progress("%s: p50 %s, p99 %s, max %s, %.0f jobs/s committed", label, row.p50, row.p99, row.max, achieved)
	}
	row.target = strings.Join(targets, ", ")
	row.result = b.verdict(ok)
	return row, nil
}

// percentile returns the q-quantile of sorted (nearest rank).
func percentile(sorted []time.Duration, q float64) time.Duration {
	i := int(math.Ceil(q*float64(len(sorted)))) - 1
	return sorted[min(max(i, 0), len(sorted)-1)]
}

// The idle scenario's targets.
const (
	// idleStatementsTarget is the most statements a second an idle relay
	// may send PostgreSQL. Outside an explicit transaction every statement
	// is a transaction of its own, an empty one (a ping) included, and
	// pg_stat_database counts each. 4 a second are the leader's keepalive
	// pings on its lock session (every LeaderInterval/2, 250ms: empty
	// statements, no transaction id, no WAL), which let a frozen leader
	// lose its lock within 1.25s; about 1 a second is the fallback poll's
	// claim. Until the bench counted the lock session (it flushes its
	// statistics only when it ends) the target was 2/s of what it saw.
	idleStatementsTarget = 6.0
	// idleXidsTarget is the most transaction ids an idle relay may use per
	// idleXidsPer: its listener's heartbeat (a pg_notify, which takes one)
	// after every 30s without a notification, and nothing else.
	idleXidsTarget = 1.0
	idleXidsPer    = 30 * time.Second
)

// idleReading is what PostgreSQL has counted so far, read in one statement.
type idleReading struct {
	xacts  int64 // xact_commit + xact_rollback of the database of staged_jobs
	others int64 // rows inserted, updated or deleted in every other database
	xid    int64 // pg_snapshot_xmax(pg_current_snapshot()): the next transaction id, cluster-wide
	wal    int64 // pg_current_wal_insert_lsn(), in bytes, cluster-wide
}

func (r idleReading) sub(o idleReading) idleReading {
	return idleReading{xacts: r.xacts - o.xacts, others: r.others - o.others, xid: r.xid - o.xid, wal: r.wal - o.wal}
}

// idleReadingSQL reads an idleReading of database $1. It takes no
// transaction id and writes no WAL; it is one transaction of the database
// admin is connected to, never of $1's. The WAL position is the insert
// position, not pg_current_wal_lsn()'s write position, which lags behind
// commits that do not wait for their flush (the relay's sessions run with
// synchronous_commit off).
const idleReadingSQL = `SELECT
	(SELECT coalesce(sum(xact_commit + xact_rollback), 0)::bigint FROM pg_stat_database WHERE datname = $1),
	(SELECT coalesce(sum(tup_inserted + tup_updated + tup_deleted), 0)::bigint FROM pg_stat_database WHERE datname IS DISTINCT FROM $1),
	pg_snapshot_xmax(pg_current_snapshot())::text::bigint,
	pg_wal_lsn_diff(pg_current_wal_insert_lsn(), '0/0')::bigint`

func readIdle(ctx context.Context, admin *pgx.Conn, database string) (idleReading, error) {
	var r idleReading
	if err := admin.QueryRow(ctx, idleReadingSQL, database).Scan(&r.xacts, &r.others, &r.xid, &r.wal); err != nil {
		return r, fmt.Errorf("read pg_stat_database, the snapshot and the WAL position: %w", err)
	}
	return r, nil
}

// sessionsGoneTimeout bounds the wait for sessions that have been told to
// end (a relay that exited, a connection closed) to leave the server.
const sessionsGoneTimeout = 30 * time.Second

// waitSessionsGone waits, up to timeout, until database has no session whose
// application_name ends in suffix ("" for every session but admin's). A
// backend adds what it counted to pg_stat_database before it leaves
// pg_stat_activity; until then, PostgreSQL 15 holds back the counts of a
// session that runs no statement touching a table (the relay's lock
// session, whose pings are empty statements) until it ends.
func waitSessionsGone(ctx context.Context, admin *pgx.Conn, database, suffix string, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for {
		var n int
		err := admin.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity
			WHERE datname = $1 AND pid <> pg_backend_pid() AND right(coalesce(application_name, ''), length($2)) = $2`,
			database, suffix).Scan(&n)
		if err != nil {
			return fmt.Errorf("read pg_stat_activity: %w", err)
		}
		if n == 0 {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("%d sessions of database %s still connected %s after they should have ended", n, database, timeout)
		}
		if err := sleepCtx(ctx, 20*time.Millisecond); err != nil {
			return err
		}
	}
}

// idleRun is one relay run of the idle scenarios, from start to exit:
// ready (a probe job delivered in each schema), then idle for warm, then,
// with window > 0, for window more, read live at its start and end.
type idleRun struct {
	whole    idleReading   // what PostgreSQL counted from before the start to after the sessions ended
	ran      time.Duration // from the start (or readiness: fromReady) to SIGTERM
	sessions int           // the relay's sessions at the end of its idle time
	live     idleReading   // what PostgreSQL counted over the window, read while the relay ran
	span     time.Duration // the window's length, as measured
}

// runIdle runs one relay of the idle scenario, of the scratch schema.
func (b *bench) runIdle(ctx context.Context, admin *pgx.Conn, warm, window time.Duration) (idleRun, error) {
	return b.runIdleOn(ctx, admin, warm, window, nil, nil, false)
}

// runIdleOn is runIdle of a relay --schemas of tenants (nil: --schema, of
// the scratch schema), whose readiness is probed in each of them. With
// fromReady, the run's time is from its readiness, not its start, to its
// SIGTERM: for a relay whose start takes long (many schemas) and varies,
// that is the better span.
//
// The transaction ids and the WAL position are read live at the window's
// start and end: both only grow, so their difference is never negative.
// pg_stat_database's counts are not live (a session that runs only empty
// statements adds them when it ends), so they are read around the whole
// run.
func (b *bench) runIdleOn(ctx context.Context, admin *pgx.Conn, warm, window time.Duration, tenants []string, schemaArgs []string, fromReady bool) (idleRun, error) {
	var run idleRun
	tables := []string{b.table()}
	if tenants != nil {
		tables = b.tenantTables(tenants)
	}
	conn, err := b.connect(ctx)
	if err != nil {
		return run, err
	}
	err = b.resetTables(ctx, conn, tables)
	conn.Close(context.WithoutCancel(ctx))
	if err != nil {
		return run, err
	}
	if b.scratchDB != "" {
		// This bench's sessions too: the reset's, the previous scenario's.
		if err := waitSessionsGone(ctx, admin, b.database, "", sessionsGoneTimeout); err != nil {
			return run, err
		}
	}
	r0, err := readIdle(ctx, admin, b.database)
	if err != nil {
		return run, err
	}
	if schemaArgs == nil {
		schemaArgs = []string{"--schema", b.schema}
	}
	p, err := b.startRelayOn(false, schemaArgs...)
	if err != nil {
		return run, err
	}
	started := time.Now()
	if err := b.probeAll(ctx, p, tables); err != nil {
		return run, err
	}
	if fromReady {
		started = time.Now()
	}
	if err := sleepCtx(ctx, warm); err != nil {
		return run, err
	}
	if window > 0 {
		w0, err := readIdle(ctx, admin, b.database)
		if err != nil {
			return run, err
		}
		opened := time.Now()
		if err := sleepCtx(ctx, window); err != nil {
			return run, err
		}
		w1, err := readIdle(ctx, admin, b.database)
		if err != nil {
			return run, err
		}
		run.live, run.span = w1.sub(w0), time.Since(opened)
	}
	if err := p.exited(); err != nil {
		return run, err
	}
	run.ran = time.Since(started)
	pid := p.cmd.Process.Pid
	if run.sessions, err = relaySessions(ctx, admin, b.database, pid); err != nil {
		return run, err
	}
	if _, err := b.stopRelay(); err != nil {
		return run, err
	}
	// The relay's sessions are named "stagedrain <role> <host>:<pid>".
	if err := waitSessionsGone(ctx, admin, b.database, ":"+strconv.Itoa(pid), sessionsGoneTimeout); err != nil {
		return run, err
	}
	r1, err := readIdle(ctx, admin, b.database)
	if err != nil {
		return run, err
	}
	run.whole = r1.sub(r0)
	return run, nil
}

// idleStatements is the statements a second of an idle relay: the
// difference of what PostgreSQL counted in a long run and a short one, over
// the difference of their times. Start-up, the probe jobs and shutdown
// cancel out, but not exactly: when the short run counted more (a retry in
// its start-up, an autovacuum visit), the figure is 0 and clamped says so.
func idleStatements(short, long idleRun) (perSecond float64, span time.Duration, clamped bool, err error) {
	span = long.ran - short.ran
	if span <= 0 {
		return 0, 0, false, fmt.Errorf("the longer relay run (%s) was not longer than the shorter one (%s)", long.ran, short.ran)
	}
	d := long.whole.xacts - short.whole.xacts
	if d < 0 {
		return 0, span, true, nil
	}
	return float64(d) / span.Seconds(), span, false, nil
}

// benchIdle measures what a relay with nothing to do costs PostgreSQL: the
// statements it sends (each a transaction, counted by pg_stat_database),
// the transaction ids it uses and the WAL it causes.
//
// PostgreSQL 15 adds a session's transactions to pg_stat_database only
// when the session flushes its statistics, which a session running only
// empty statements (the relay's lock session: its keepalive pings) does
// when it ends. So statements are read around a whole relay run, from
// before it starts to after its sessions have ended, and the idle window
// is the difference of two runs that differ only in how long they idle:
// warm-up, and warm-up plus window. Start-up, the probe job and shutdown
// cancel out. Transaction ids and WAL are read live, at the window's start
// and end, in the longer run.
//
// Transaction ids and WAL are cluster-wide: any other database's writes
// add to them. They are judged when they meet their targets (an upper
// bound that passes) or when no other database changed a row during the
// window; else they are not judged. Statements are those of the scratch
// database, where the relay is the only client (an autovacuum worker
// visiting it would add its own); without CREATEDB, every session of the
// user's database counts, an upper bound.
//
// The listener's heartbeat, the one transaction id of an idle relay, comes
// after 30s without a notification: the full window (60s) holds two, the
// quick one (1s) none, and quick figures are not judged.
func (b *bench) benchIdle(ctx context.Context) error {
	admin, err := pgx.Connect(ctx, b.baseURL)
	if err != nil {
		return fmt.Errorf("connect: %w", err)
	}
	defer admin.Close(context.WithoutCancel(ctx))
	warm, window := b.cfg.IdleWarmup, b.cfg.IdleWindow
	b.progress("idle: a relay run idle for %s, then one idle for %s more ...", warm, window)
	short, err := b.runIdle(ctx, admin, warm, 0)
	if err != nil {
		return err
	}
	long, err := b.runIdle(ctx, admin, warm, window)
	if err != nil {
		return err
	}
	stmts, span, clamped, err := idleStatements(short, long)
	if err != nil {
		return err
	}
	live := long.live
	busy := live.others
	xids := float64(live.xid) * idleXidsPer.Seconds() / long.span.Seconds()
	b.progress("idle: %.2f statements/s over %s (two runs' difference); over the %s window: %d transaction ids, %s bytes of WAL, %d rows changed in other databases",
		stmts, span.Round(time.Millisecond), long.span.Round(time.Millisecond), live.xid, fmtInt(live.wal), busy)

	// A figure that is an upper bound of the relay's (other sessions
	// counted too, why says which) passes when it meets its target, and
	// is not judged when it does not.
	judge := func(ok bool, why string) string {
		switch {
		case b.cfg.Quick:
			return notJudgedQuick
		case ok:
			return "PASS"
		case why != "":
			return "not judged (" + why + ")"
		}
		return "MISS"
	}
	window0 := long.span.Round(100 * time.Millisecond)
	runs := fmt.Sprintf("two relay runs, idle %s and %s, each counted from before its start to after its sessions ended: the difference", warm, warm+window)
	stmtNote := "pg_stat_database of scratch database " + b.database + ", empty statements (pings) included; " + runs
	stmtWhy := ""
	if b.scratchDB == "" {
		stmtNote = "pg_stat_database of " + b.database + ": counts ALL its sessions (no CREATEDB), an upper bound; " + runs
		stmtWhy = "shared database"
	}
	if clamped {
		stmtNote += clampNote(clamped, short, long)
		stmtWhy = "runs differ"
	}
	cluster := fmt.Sprintf("cluster-wide, read at the window's start and end while the relay idled; %d rows changed in other databases meanwhile", busy)
	clusterWhy := ""
	switch {
	case b.scratchDB == "":
		cluster, clusterWhy = cluster+", and the user's database has other sessions: an upper bound", "shared database"
	case busy > 0:
		cluster, clusterWhy = cluster+": an upper bound", "busy server"
	}
	heartbeat := ""
	if window < 2*idleXidsPer {
		heartbeat = fmt.Sprintf("; the listener's heartbeat comes after %s without a notification: a %s window is too short to count it", idleXidsPer, window)
	}
	b.rows = append(b.rows,
		benchRow{scenario: "idle relay: PostgreSQL statements (transactions)", offered: "0",
			achieved: fmt.Sprintf("%.2f/s", stmts), target: fmt.Sprintf("<= %g/s", idleStatementsTarget),
			result: judge(!clamped && stmts <= idleStatementsTarget, stmtWhy), note: stmtNote},
		benchRow{scenario: "idle relay: transaction ids", offered: "0",
			achieved: fmt.Sprintf("%d in %s", live.xid, window0), target: fmt.Sprintf("<= %g per %s", idleXidsTarget, idleXidsPer),
			result: judge(xids <= idleXidsTarget, clusterWhy),
			note:   fmt.Sprintf("pg_snapshot_xmax(pg_current_snapshot()): %.2f per %s; %s%s", xids, idleXidsPer, cluster, heartbeat)},
		benchRow{scenario: "idle relay: WAL", offered: "0",
			achieved: fmt.Sprintf("%s B in %s", fmtInt(live.wal), window0),
			note:     fmt.Sprintf("pg_wal_lsn_diff of pg_current_wal_insert_lsn(): %s B/min; %s", fmtInt(int64(float64(live.wal)*60/long.span.Seconds())), cluster)},
	)
	return nil
}

// backlogQueues is how many queues the backlog's jobs are spread over.
const backlogQueues = 4

// benchBacklog stages the backlog while no relay runs, then starts one and
// watches Redis (LLEN of the queues, every 5ms) as it drains.
func (b *bench) benchBacklog(ctx context.Context) error {
	total := int64(b.cfg.Backlog)
	conn, err := b.connect(ctx)
	if err != nil {
		return err
	}
	defer conn.Close(context.WithoutCancel(ctx))
	if err := b.reset(ctx, conn); err != nil {
		return err
	}
	b.progress("backlog: staging %s jobs ...", fmtInt(total))
	const chunk = 100_000
	for lo := int64(1); lo <= total; lo += chunk {
		hi := min(total, lo+chunk-1)
		if _, err := conn.Exec(ctx, "INSERT INTO "+b.table()+" (job_name, job_args, queue)"+
			" SELECT 'BenchBacklogJob', jsonb_build_array(g), 'backlog' || (g % "+strconv.Itoa(backlogQueues)+")"+
			" FROM generate_series($1::bigint, $2::bigint) g", lo, hi); err != nil {
			return fmt.Errorf("stage the backlog: %w", err)
		}
		if hi%500_000 == 0 && hi < total {
			b.progress("backlog: %s staged", fmtInt(hi))
		}
	}
	// Autovacuum would analyze a table that grew so much; do it now so the
	// relay's claims are planned as they would be.
	if _, err := conn.Exec(ctx, "ANALYZE "+b.table()); err != nil {
		return fmt.Errorf("analyze: %w", err)
	}
	keys := make([]string, backlogQueues)
	for i := range keys {
		keys[i] = b.queueKey("backlog" + strconv.Itoa(i))
	}
	inRedis := func() (int64, error) {
		cmds, err := b.rdb.Pipelined(ctx, func(pipe redis.Pipeliner) error {
			for _, k := range keys {
				pipe.LLen(ctx, k)
			}
			return nil
		})
		if err != nil {
			return 0, fmt.Errorf("LLEN: %w", err)
		}
		var n int64
		for _, c := range cmds {
			n += c.(*redis.IntCmd).Val()
		}
		return n, nil
	}

	b.progress("backlog: draining %s jobs ...", fmtInt(total))
	p, err := b.startRelay(false)
	if err != nil {
		return err
	}
	started := time.Now()
	deadline := started.Add(time.Minute + time.Duration(total)*50*time.Microsecond)
	// Every observation from the first job in Redis on: the tenths are
	// measured between observations, whatever a batch's size.
	type mark struct {
		at time.Time
		n  int64
	}
	var seen []mark
	lastProgress := started
	for {
		if err := p.exited(); err != nil {
			return err
		}
		n, err := inRedis()
		if err != nil {
			return err
		}
		now := time.Now()
		if n > 0 {
			seen = append(seen, mark{now, n})
		}
		if n >= total {
			break
		}
		if now.After(deadline) {
			return fmt.Errorf("%s of %s jobs in Redis after %s", fmtInt(n), fmtInt(total), now.Sub(started).Round(time.Second))
		}
		if now.Sub(lastProgress) >= time.Second {
			b.progress("backlog: %s of %s in Redis", fmtInt(n), fmtInt(total))
			lastProgress = now
		}
		if err := sleepCtx(ctx, 5*time.Millisecond); err != nil {
			return err
		}
	}
	first, done := seen[0], seen[len(seen)-1]
	tenth := done // the first observation a tenth of the jobs after the first
	for _, m := range seen {
		if m.n-first.n >= total/10 {
			tenth = m
			break
		}
	}
	ninety := first // the last observation with at most nine tenths in Redis
	for _, m := range seen {
		if m.n <= total-total/10 {
			ninety = m
		}
	}
	rss, err := b.stopRelay()
	if err != nil {
		return err
	}
	rate := func(from, to mark) float64 {
		return float64(to.n-from.n) / max(to.at.Sub(from.at), time.Millisecond).Seconds()
	}
	overall, firstTenth, lastTenth := rate(first, done), rate(first, tenth), rate(ninety, done)
	b.progress("backlog: %.0f jobs/s overall, first tenth %.0f/s, last tenth %.0f/s, peak RSS %s", overall, firstTenth, lastTenth, fmtBytes(rss))
	// A backlog that reached Redis in too few observations (a small one,
	// a fast machine) has no first and last tenth to compare.
	tenths := benchRow{scenario: "backlog drain, last tenth vs first tenth", offered: "backlog", target: ">= 90%"}
	if firstTenth > 0 && lastTenth > 0 && tenth != done && ninety != first {
		tenths.achieved = fmt.Sprintf("%.0f%%", 100*lastTenth/firstTenth)
		tenths.result = b.verdict(lastTenth >= 0.9*firstTenth)
		tenths.note = fmt.Sprintf("first tenth %s/s, last tenth %s/s", fmtRate(firstTenth), fmtRate(lastTenth))
	} else {
		tenths.result = "not judged (too few observations)"
		tenths.note = fmt.Sprintf("the backlog reached Redis in %d observations, too few to tell its first tenth from its last", len(seen))
	}
	backlogRow := fmt.Sprintf("backlog drain, %d queues", backlogQueues)
	if b.cfg.Target != relay.TargetSidekiq {
		backlogRow += ", --target " + string(b.cfg.Target)
	}
	b.rows = append(b.rows,
		benchRow{scenario: backlogRow,
			offered: "backlog", achieved: fmtRate(overall), target: ">= 150,000/s", result: b.verdict(overall >= 150_000),
			note: fmt.Sprintf("%s jobs, from the first batch in Redis (%s after the relay started) to the last; LLEN every 5ms", fmtInt(total), first.at.Sub(started).Round(time.Millisecond))},
		tenths,
		benchRow{scenario: "relay peak RSS (VmHWM), backlog drain", achieved: fmtBytes(rss),
			target: "<= 32 MiB", result: b.verdict(rss <= 32<<20),
			note: "highest of every relay run: " + fmtBytes(b.peakRSS)},
	)
	return nil
}

// sleepCtx waits for d, or returns ctx's error when it ends first.
func sleepCtx(ctx context.Context, d time.Duration) error {
	if d <= 0 {
		return ctx.Err()
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-t.C:
		return nil
	}
}

// verdict is the result of a row with a target: PASS or MISS, or, in a
// quick run, whose scenarios are too short and too small for any target
// (a 10,000-job backlog drains in a few batches, a latency rate runs for
// 50 jobs), "not judged (quick)".
func (b *bench) verdict(ok bool) string {
	switch {
	case b.cfg.Quick:
		return notJudgedQuick
	case ok:
		return "PASS"
	}
	return "MISS"
}

// notJudgedQuick is the result of every row with a target in a quick run.
const notJudgedQuick = "not judged (quick)"

func fmtRate(r float64) string { return fmtInt(int64(math.Round(r))) }

// fmtInt writes n with thousands separators: 1,000,000.
func fmtInt(n int64) string {
	s := strconv.FormatInt(n, 10)
	neg := strings.HasPrefix(s, "-")
	s = strings.TrimPrefix(s, "-")
	for i := len(s) - 3; i > 0; i -= 3 {
		s = s[:i] + "," + s[i:]
	}
	if neg {
		s = "-" + s
	}
	return s
}

func fmtDuration(d time.Duration) string {
	return strconv.FormatFloat(float64(d)/float64(time.Millisecond), 'f', 2, 64) + "ms"
}

func fmtBytes(n int64) string {
	return strconv.FormatFloat(float64(n)/(1<<20), 'f', 1, 64) + " MiB"
}

// consume pops the jobs of key with two consumers until finish is called,
// handing each to record with when it arrived (since base); finish returns
// the first error a consumer met.
func (b *bench) consume(ctx context.Context, key string, base time.Time, record func(job string, at time.Duration)) (finish func() error) {
	stop := make(chan struct{})
	var consumers errgroup.Group
	for range 2 {
		consumers.Go(func() error {
			for {
				select {
				case <-stop:
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
	return func() error {
		close(stop)
		return consumers.Wait()
	}
}
