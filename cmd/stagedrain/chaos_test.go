package main

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/redis/go-redis/v9"

	"github.com/stagedrain/stagedrain/relay"
	"github.com/stagedrain/stagedrain/relay/relaytest"
)

// TestChaos runs two stagedrain relays (a leader and a standby) against a
// private PostgreSQL and Redis while producers stage jobs, commit and roll
// back, and faults hit (chaosFaultKinds): the leader SIGKILLed (and a new
// relay started) and SIGSTOPped, every relay SIGSTOPped at once, the leader
// SIGSTOPped with no standby, PostgreSQL restarted, Redis killed and
// restarted on its port (with an fsynced append-only file, so it keeps what
// it acknowledged), Redis SIGSTOPped for longer than the relays' read
// timeout, poison rows planted. Once the producers stop and the relays
// drain, every committed job must be in Redis exactly once (its jid in one
// entry), where it belongs, no rolled-back job at all, staged_jobs empty,
// and staged_jobs_dead exactly the planted rows.
//
// Each job carries a unique marker in its args, and each transaction
// INSERTs its id into a ledger table beside its jobs (the app's own data),
// so a transaction whose COMMIT failed in flight (PostgreSQL stopping) is
// known, afterwards, to have committed or not.
//
// By default a short run (tens of thousands of jobs, a few faults, under a
// minute); -chaos.full runs the size (see chaosPlanFor), and
// -chaos.rate, -chaos.window, -chaos.only and -chaos.each change it.
// -chaos.schemas N runs it as TestChaosSchemas does, over N schemas;
// -chaos.logs keeps the relays' output.
func TestChaos(t *testing.T) {
	testChaos(t, *chaosSchemas)
}

// TestChaosSchemas is TestChaos with the relays of a fleet: each runs
// `stagedrain run --schemas chaos_*` over chaosShortSchemas schemas (or
// -chaos.schemas), the producers' transactions each go to a random
// schema, poison is planted in a random schema (and must be dead-lettered
// in that schema's staged_jobs_dead), and the faults aimed at "the leader"
// strike the relay that leads the most schemas (see leader). Under
// -chaos.full it is skipped: the full run is TestChaos -chaos.schemas N.
func TestChaosSchemas(t *testing.T) {
	if *chaosFull {
		t.Skip("-chaos.full: run TestChaos with -chaos.schemas")
	}
	testChaos(t, cmp.Or(*chaosSchemas, chaosShortSchemas))
}

// testChaos is TestChaos over schemas schemas (0: one, with --schema).
func testChaos(t *testing.T, schemas int) {
	plan := chaosPlanFromFlags(t)
	if schemas > 0 {
		plan.name += fmt.Sprintf(" schemas=%d", schemas)
	}
	seed := cmp.Or(*chaosSeed, time.Now().UnixNano())
	// Registered first, so it runs last, after the relays' output: a
	// failing run's log ends with what failed (CI shows the end of it).
	var c *chaos
	var f *chaosFigures
	t.Cleanup(func() {
		if !t.Failed() {
			return
		}
		// What failed comes last of all: CI may show only the last
		// lines of the output.
		var b strings.Builder
		fmt.Fprintf(&b, "chaos %s FAILED, seed %d", plan.name, seed)
		if c != nil {
			tl := strings.Split(strings.TrimRight(c.timelineText(), "\n"), "\n")
			fmt.Fprintf(&b, "\ntimeline, the last %d lines:\n%s", min(len(tl), 15), strings.Join(tl[max(0, len(tl)-15):], "\n"))
		}
		if f != nil {
			fmt.Fprintf(&b, "\n%s", f.summary())
			for _, p := range f.problems {
				fmt.Fprintf(&b, "\n- %s", p)
			}
			// When and during what the duplicates were pushed, and the
			// timeline between the two pushes: the first thing to read.
			for _, d := range f.duplicateCauses {
				fmt.Fprintf(&b, "\n- duplicates: %s", d)
			}
		}
		if f == nil || len(f.problems) == 0 {
			fmt.Fprintf(&b, "\nthe figures found nothing wrong: what failed is logged above (a fault, a relay's exit or a wait)")
		}
		t.Log(b.String())
	})
	c = newChaos(t, plan, seed, schemas)
	plan = c.plan // with redisStallFor
	if *chaosLogs != "" {
		// Registered before any relay starts: runs after their cleanups,
		// once each has exited and its output is whole.
		t.Cleanup(func() { c.writeLogs(*chaosLogs) })
	}
	t.Logf("chaos %s: seed %d, %d producers, %d committed jobs (%d jobs/s, %d-%d per transaction) over %s; faults %s; SIGSTOPs of relays %s, Redis stall %s",
		plan.name, seed, plan.producers, plan.committed(), plan.rate, plan.txMin, plan.txMax, plan.window, chaosFaultCounts(plan.faults),
		plan.pauseFor, plan.redisStallFor)
	defer func() { t.Logf("timeline:\n%s", c.timelineText()) }() // also when a wait fails the test
	c.run()
	f = c.verdict()
	f.log(t)
	f.check(t)
}

// writeLogs writes each relay's output to dir/relay-N.log.
func (c *chaos) writeLogs(dir string) {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		c.t.Errorf("-chaos.logs: %v", err)
		return
	}
	for i, p := range c.relays {
		path := filepath.Join(dir, fmt.Sprintf("relay-%d.log", i+1))
		if err := os.WriteFile(path, []byte(p.output()), 0o644); err != nil {
			c.t.Errorf("-chaos.logs: %v", err)
			return
		}
	}
	c.t.Logf("relays' output in %s", dir)
}

// chaos is one TestChaos run: the servers, the relays, the producers'
// transactions and what happened when.
type chaos struct {
	t     *testing.T
	ctx   context.Context
	plan  chaosPlan
	rng   *rand.Rand
	seed  int64
	pg    *relaytest.PostgresServer
	redis *relaytest.RedisServer
	rdb   *redis.Client

	layout chaosLayout // where -chaos.target's jobs land

	schemas []string            // the schemas drained: "chaos" alone, or chaos_00... with -chaos.schemas
	fleet   bool                // the relays run --schemas chaos_*, not --schema chaos
	sql     map[string]chaosSQL // by schema
	conn    *pgx.Conn           // the controller's, reconnected after a restart (see db)

	relays []*proc    // every relay started, in order
	live   [2]*proc   // the two running now
	start  time.Time  // when the producers started
	txs    []*chaosTx // every transaction staged, once the producers are done

	timeline []chaosNote
	ran      []chaosRun // the faults, in the order they ran
	faults   map[string]int
	gap      deliveryGap
}

// chaosSQL is the statements the producers run.
type chaosSQL struct {
	ledger string // $1: the transaction's id
	stage  string // $1 job_args (JSON text), $2 queues, $3 scheduled: arrays
}

// newChaos starts the servers and migrates the schema "chaos", or with
// schemas > 0 that many schemas chaos_00, chaos_01...: each with a ledger
// of its own.
func newChaos(t *testing.T, plan chaosPlan, seed int64, schemas int) *chaos {
	t.Helper()
	c := &chaos{
		t: t, ctx: t.Context(), plan: plan, seed: seed, rng: rand.New(rand.NewPCG(uint64(seed), 0)),
		schemas: []string{"chaos"}, faults: make(map[string]int), sql: make(map[string]chaosSQL),
		layout: chaosLayoutOf(t),
	}
	if schemas > 0 {
		c.fleet, c.schemas = true, nil
		for i := range schemas {
			c.schemas = append(c.schemas, fmt.Sprintf("%s%02d", chaosSchemaPrefix, i))
		}
	}
	c.pg = relaytest.StartPostgres(t)
	c.redis = relaytest.StartRedis(t, "--appendonly", "yes", "--appendfsync", "always")
	c.plan.redisStallFor = relayReadTimeout(t, c.redis.URL()) + chaosStallMargin
	c.rdb = redis.NewClient(&redis.Options{Addr: fmt.Sprintf("127.0.0.1:%d", c.redis.Port), DisableIdentity: true})
	t.Cleanup(func() { _ = c.rdb.Close() })
	t.Cleanup(func() {
		if c.conn != nil {
			_ = c.conn.Close(context.Background())
		}
	})

	for _, schema := range c.schemas {
		if _, err := relay.Migrate(c.ctx, c.db(), schema); err != nil {
			t.Fatalf("migrate %s: %v", schema, err)
		}
		ledger := pgx.Identifier{schema, "chaos_ledger"}.Sanitize()
		if _, err := c.db().Exec(c.ctx, "CREATE TABLE "+ledger+" (tx text PRIMARY KEY)"); err != nil {
			t.Fatal(err)
		}
		c.sql[schema] = chaosSQL{
			ledger: "INSERT INTO " + ledger + " (tx) VALUES ($1)",
			stage: "INSERT INTO " + pgx.Identifier{schema, "staged_jobs"}.Sanitize() + ` (job_name, job_args, queue, run_at)
			SELECT 'ChaosJob', a::jsonb, q, CASE WHEN s THEN ` + c.layout.runAt + ` END
			FROM unnest($1::text[], $2::text[], $3::bool[]) AS u(a, q, s)`,
		}
	}
	if err := c.rdb.Set(c.ctx, c.layout.list(chaosWrongTypeQueue), "not a list", 0).Err(); err != nil {
		t.Fatal(err)
	}
	return c
}

// db returns the controller's connection, connecting again if it broke
// (PostgreSQL restarted).
func (c *chaos) db() *pgx.Conn {
	c.t.Helper()
	relaytest.WaitFor(c.t, 30*time.Second, "a connection to the private PostgreSQL", func() (bool, string) {
		ctx, cancel := context.WithTimeout(c.ctx, 2*time.Second)
		defer cancel()
		if c.conn != nil {
			if err := c.conn.Ping(ctx); err == nil {
				return true, ""
			}
			_ = c.conn.Close(ctx)
			c.conn = nil
		}
		conn, err := pgx.Connect(ctx, c.pg.URL())
		if err != nil {
			return false, err.Error()
		}
		c.conn = conn
		return true, ""
	})
	return c.conn
}

// chaosRun is one fault that ran, from when it started to when it ended.
type chaosRun struct {
	fault    string
	from, to time.Time
}

// chaosNote is a line of the run's timeline.
type chaosNote struct {
	at   time.Time
	what string
}

// note adds a line to the timeline.
func (c *chaos) note(format string, args ...any) {
	c.timeline = append(c.timeline, chaosNote{at: time.Now(), what: fmt.Sprintf(format, args...)})
}

// offset is t as seconds after the producers started.
func (c *chaos) offset(t time.Time) string {
	if c.start.IsZero() {
		return "+0.00s"
	}
	return fmt.Sprintf("%+.2fs", t.Sub(c.start).Seconds())
}

func (c *chaos) timelineText() string {
	var b strings.Builder
	for _, n := range c.timeline {
		fmt.Fprintf(&b, "  %8s %s\n", c.offset(n.at), n.what)
	}
	return b.String()
}

// between lists the timeline's lines from from to to.
func (c *chaos) between(from, to time.Time) []string {
	var out []string
	for _, n := range c.timeline {
		if !n.at.Before(from) && !n.at.After(to) {
			out = append(out, c.offset(n.at)+" "+n.what)
		}
	}
	return out
}

// startRelay starts one more relay on the private servers.
func (c *chaos) startRelay() *proc {
	c.t.Helper()
	name := fmt.Sprintf("relay %d", len(c.relays)+1)
	p := startProc(c.t, name, childEnv("DATABASE_URL="+c.pg.URL(), "REDIS_URL="+c.redis.URL()),
		"run", "--target", c.layout.target, c.schemaFlag(), c.schemaArg(), "--max-payload-bytes", fmt.Sprint(chaosMaxPayloadBytes), "--max-backoff", "1s")
	p.failTail = 40
	c.relays = append(c.relays, p)
	c.note("%s started (pid %d)", name, p.cmd.Process.Pid)
	return p
}

// schemaFlag and schemaArg are the relays' --schema chaos, or --schemas
// chaos_*.
func (c *chaos) schemaFlag() string {
	if c.fleet {
		return "--schemas"
	}
	return "--schema"
}

func (c *chaos) schemaArg() string {
	if c.fleet {
		return chaosSchemaPrefix + "*"
	}
	return c.schemas[0]
}

// tables is the union of table of every schema, for a count or a read:
// SELECT cols (and the schema's name, as a text, with withSchema) FROM
// each.
func (c *chaos) tables(table, cols string, withSchema bool) string {
	var parts []string
	for _, schema := range c.schemas {
		sel := cols
		if withSchema {
			sel = "'" + schema + "'::text, " + cols
		}
		parts = append(parts, "SELECT "+sel+" FROM "+pgx.Identifier{schema, table}.Sanitize())
	}
	return strings.Join(parts, " UNION ALL ")
}

// staged counts the rows staged in every schema.
func (c *chaos) staged() (int, error) {
	var n int
	err := c.db().QueryRow(c.ctx, "SELECT count(*) FROM ("+c.tables("staged_jobs", "1", false)+") AS u").Scan(&n)
	return n, err
}

// run starts the relays, then the producers, runs the faults, waits for the
// producers to commit their quota and for the relays to drain everything.
func (c *chaos) run() {
	t := c.t
	c.live[0] = c.startRelay()
	if c.fleet {
		c.waitLed(func(counts [2]int) bool { return counts[0] == len(c.schemas) }, "relay 1 to lead every schema")
		c.live[1] = c.startRelay()
		c.waitBalanced()
	} else {
		c.live[0].waitLog(rootLogger, "became leader", 15*time.Second)
		c.live[1] = c.startRelay()
		c.live[1].waitLog(rootLogger, "standby: another relay is draining this schema", 15*time.Second)
	}

	sampler, stopSampler := context.WithCancel(c.ctx)
	var sampled sync.WaitGroup
	sampled.Go(func() { c.gap = sampleDeliveries(sampler, c.redis.Port, c.layout) })
	defer func() { stopSampler(); sampled.Wait() }()

	c.start = time.Now()
	c.note("producers started")
	producers := make([]*chaosProducer, c.plan.producers)
	pctx, cancel := context.WithTimeout(c.ctx, c.plan.deadline)
	defer cancel()
	var produced sync.WaitGroup
	for i := range producers {
		p := &chaosProducer{c: c, id: i + 1, quota: (c.plan.committed() + c.plan.producers - 1) / c.plan.producers,
			rng: rand.New(rand.NewPCG(uint64(c.seed), uint64(i+1)))}
		producers[i] = p
		produced.Go(func() { p.run(pctx) })
	}

	for _, ev := range c.schedule() {
		if !c.pause(time.Until(c.start.Add(ev.at))) {
			t.Fatal("the test's context ended")
		}
		c.faults[ev.fault.name]++
		from := time.Now()
		ev.fault.do(c)
		c.ran = append(c.ran, chaosRun{fault: ev.fault.name, from: from, to: time.Now()})
	}
	c.note("faults done")
	produced.Wait()
	backlog, err := c.staged()
	c.note("producers done: %d rows staged (%v)", backlog, err)
	for _, p := range producers {
		c.txs = append(c.txs, p.txs...)
		if p.committed < p.quota {
			t.Fatalf("producer %d committed %d jobs of its %d within %s; the relays may have stalled its commits", p.id, p.committed, p.quota, c.plan.deadline)
		}
	}

	relaytest.WaitFor(t, 2*time.Minute, "staged_jobs drained", func() (bool, string) {
		n, err := c.staged()
		return err == nil && n == 0, fmt.Sprintf("%d rows staged, %v", n, err)
	})
	c.note("staged_jobs drained")
	stopSampler()
	sampled.Wait()
}

// pause waits d: the scenario's own pacing, not a synchronization.
func (c *chaos) pause(d time.Duration) bool { return pauseCtx(c.ctx, d) }

// chaosJob is one staged job: its marker (unique, its args' first element)
// and where it should land.
type chaosJob struct {
	marker    string
	queue     string
	scheduled bool
	poison    string // "", or "oversize" or "wrongtype": the relay dead-letters it
}

// chaosTx is one producer transaction and what became of it.
type chaosTx struct {
	id      string
	schema  string // whose staged_jobs and chaos_ledger it writes
	jobs    []chaosJob
	commit  bool          // false: rolled back on purpose
	hold    time.Duration // held open this long before COMMIT or ROLLBACK
	outcome txOutcome
}

func (tx *chaosTx) add(queue string, scheduled bool, poison string) {
	tx.jobs = append(tx.jobs, chaosJob{marker: tx.id + "." + strconv.Itoa(len(tx.jobs)), queue: queue, scheduled: scheduled, poison: poison})
}

type txOutcome int

const (
	txFailed     txOutcome = iota // failed before COMMIT: not committed
	txCommitted                   // COMMIT succeeded
	txRolledBack                  // rolled back on purpose
	txInDoubt                     // COMMIT failed in flight: the ledger says whether it committed
)

func (o txOutcome) String() string {
	return [...]string{"failed", "committed", "rolled back", "in doubt"}[o]
}

// run runs tx on conn: the ledger row, its jobs, a hold, then COMMIT or
// ROLLBACK. An error means the connection may be broken.
func (s chaosSQL) run(ctx context.Context, conn *pgx.Conn, tx *chaosTx) error {
	args := make([]string, len(tx.jobs))
	queues := make([]string, len(tx.jobs))
	scheduled := make([]bool, len(tx.jobs))
	for i, j := range tx.jobs {
		// The args as JSON, by hand: json.Marshal costs the -race test
		// binary a core's share at 20,000 jobs/s. A marker is letters,
		// digits and dots (tx.add), nothing JSON would escape.
		a := `["` + j.marker + `"]`
		if j.poison == "oversize" {
			a = `["` + j.marker + `","` + strings.Repeat("x", chaosOversizedPadding) + `"]`
		}
		args[i], queues[i], scheduled[i] = a, j.queue, j.scheduled
	}
	tx.outcome = txFailed
	pgTx, err := conn.Begin(ctx)
	if err != nil {
		return err
	}
	defer func() { _ = pgTx.Rollback(context.Background()) }() // after COMMIT: does nothing
	if _, err := pgTx.Exec(ctx, s.ledger, tx.id); err != nil {
		return err
	}
	if _, err := pgTx.Exec(ctx, s.stage, args, queues, scheduled); err != nil {
		return err
	}
	if tx.hold > 0 {
		timer := time.NewTimer(tx.hold)
		defer timer.Stop()
		select {
		case <-timer.C:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	if !tx.commit {
		tx.outcome = txRolledBack
		return pgTx.Rollback(ctx)
	}
	if err := pgTx.Commit(ctx); err != nil {
		if !errors.Is(err, pgx.ErrTxCommitRollback) {
			tx.outcome = txInDoubt
		}
		return err
	}
	tx.outcome = txCommitted
	return nil
}

// chaosProducer is one app session staging jobs, on a connection of its
// own, reconnecting when PostgreSQL restarts.
type chaosProducer struct {
	c         *chaos
	id        int
	quota     int // jobs to commit
	rng       *rand.Rand
	txs       []*chaosTx
	committed int
}

// run stages transactions until the producer has committed its quota,
// spreading its commits evenly over the plan's window (faster when behind),
// until ctx ends.
func (p *chaosProducer) run(ctx context.Context) {
	var conn *pgx.Conn
	defer func() {
		if conn != nil {
			_ = conn.Close(context.Background())
		}
	}()
	plan := p.c.plan
	queues := chaosQueues()
	for seq := 0; p.committed < p.quota; seq++ {
		due := p.c.start.Add(plan.window * time.Duration(p.committed) / time.Duration(p.quota))
		if !pauseCtx(ctx, time.Until(due)) {
			return
		}
		for conn == nil {
			cctx, cancel := context.WithTimeout(ctx, 2*time.Second)
			conn, _ = pgx.Connect(cctx, p.c.pg.URL())
			cancel()
			if conn == nil && !pauseCtx(ctx, 50*time.Millisecond) { // PostgreSQL is restarting
				return
			}
		}
		tx := &chaosTx{id: fmt.Sprintf("p%d.%d", p.id, seq), commit: p.rng.Float64() >= chaosRollbackChance, schema: p.c.schemas[0]}
		if p.c.fleet {
			tx.schema = p.c.schemas[p.rng.IntN(len(p.c.schemas))]
		}
		for range plan.txMin + p.rng.IntN(plan.txMax-plan.txMin+1) {
			tx.add(queues[p.rng.IntN(len(queues))], p.rng.Float64() < chaosScheduledChance, "")
		}
		if p.rng.Float64() < plan.holdChance {
			tx.hold = plan.holdMin + time.Duration(p.rng.Int64N(int64(plan.holdMax-plan.holdMin)))
		}
		err := p.c.sql[tx.schema].run(ctx, conn, tx)
		p.txs = append(p.txs, tx)
		if tx.outcome == txCommitted {
			p.committed += len(tx.jobs)
		}
		if err != nil {
			_ = conn.Close(context.Background())
			conn = nil
		}
	}
}

// pauseCtx waits d, or until ctx ends (then it returns false).
func pauseCtx(ctx context.Context, d time.Duration) bool {
	if d <= 0 {
		return ctx.Err() == nil
	}
	timer := time.NewTimer(d)
	defer timer.Stop()
	select {
	case <-timer.C:
		return true
	case <-ctx.Done():
		return false
	}
}
