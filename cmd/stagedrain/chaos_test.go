package main

import (
	"cmp"
	"context"
	"errors"
	"flag"
	"fmt"
	"maps"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/redis/go-redis/v9"

	"github.com/stagedrain/stagedrain/relay"
	"github.com/stagedrain/stagedrain/relay/admin"
	"github.com/stagedrain/stagedrain/relay/relaytest"
)

var (
	chaosFull = flag.Bool("chaos.full", false,
		"run TestChaos at full size: 20,000 jobs/s for 90s under every kind of fault (see the README's Tests)")
	chaosRate = flag.Int("chaos.rate", 0,
		"jobs/s TestChaos's producers commit (0: the plan's, chaosFullRate or chaosShortRate)")
	chaosWindow = flag.Duration("chaos.window", 0,
		"how long TestChaos's producers commit, and its faults run (0: the plan's, chaosFullWindow or chaosShortWindow)")
	chaosOnly = flag.String("chaos.only", "",
		"run TestChaos with only these `faults` (comma-separated: kill, sigstop, pause-all, pause-solo, pg-restart, redis-kill, redis-stall, poison)")
	chaosEach = flag.Int("chaos.each", 0,
		"with -chaos.only: how many of each fault named (0: the plan's count)")
	chaosSchemas = flag.Int("chaos.schemas", 0,
		"run TestChaos's relays with --schemas over this many schemas (0: one schema, with --schema); TestChaosSchemas's default is chaosShortSchemas")
	chaosTarget = flag.String("chaos.target", "sidekiq",
		"the relays' --target: sidekiq; bullmq (jobs read from BullMQ's wait lists and delayed sets, prefix bull); or celery (whose lists are checked as Kombu names them; scheduled jobs held in PostgreSQL until due)")
	chaosLogs = flag.String("chaos.logs", "",
		"write each relay's output to `dir`/relay-N.log once TestChaos ends (a passing run shows none of it)")
)

// The load and the length of a TestChaos run, and of its longest faults.
const (
	chaosFullRate    = 20_000 // jobs/s committed: the rate at which black-box runs found duplicates (issue 15)
	chaosFullWindow  = 90 * time.Second
	chaosShortRate   = 2_000
	chaosShortWindow = 20 * time.Second

	// chaosPauseFor is how long pause-all and pause-solo hold the relays
	// stopped: longer than the relay's Redis read timeout, so a push in
	// flight when they stop has timed out when they resume.
	chaosPauseFor = 8 * time.Second
	// chaosStallMargin is how much longer than the relays' Redis read
	// timeout redis-stall holds Redis stopped: a push sent in the stall
	// times out, and a client that retries sends it again, before Redis
	// runs either.
	chaosStallMargin = 2 * time.Second

	// chaosSchemaPrefix names the schemas of a run with -chaos.schemas:
	// chaos_00, chaos_01..., which the relays' --schemas chaos_* finds.
	chaosSchemaPrefix = "chaos_"
	// chaosShortSchemas is how many schemas TestChaosSchemas drains.
	chaosShortSchemas = 20
)

// chaosPlan is the size of a TestChaos run.
type chaosPlan struct {
	name         string
	producers    int
	rate         int           // jobs/s the producers commit (planted poison aside)
	window       time.Duration // producers spread their commits, the controller its faults, over it
	deadline     time.Duration // the producers give up, and the test fails, if not done by then
	txMin, txMax int           // jobs per producer transaction

	faults map[string]int // how many of each kind (chaosFaultKinds)

	stopFor, pauseFor, pgDownFor, redisDownFor time.Duration
	redisStallFor                              time.Duration // set by newChaos: the relays' Redis read timeout + chaosStallMargin

	holdChance       float64 // of a transaction held open for holdMin to holdMax
	holdMin, holdMax time.Duration
}

// committed is how many jobs the producers commit, at least.
func (p chaosPlan) committed() int { return int(int64(p.rate) * int64(p.window) / int64(time.Second)) }

func chaosPlanFor(full bool) chaosPlan {
	if full {
		return chaosPlan{name: "full", producers: 6, rate: chaosFullRate, window: chaosFullWindow, deadline: 4 * time.Minute,
			txMin: 500, txMax: 1500,
			faults: map[string]int{"kill": 8, "sigstop": 2, "pause-all": 2, "pause-solo": 2, "pg-restart": 2,
				"redis-kill": 2, "redis-stall": 3, "poison": 4},
			stopFor: 3 * time.Second, pauseFor: chaosPauseFor, pgDownFor: time.Second, redisDownFor: 3 * time.Second,
			holdChance: 0.005, holdMin: time.Second, holdMax: 4 * time.Second}
	}
	return chaosPlan{name: "short", producers: 4, rate: chaosShortRate, window: chaosShortWindow, deadline: 60 * time.Second,
		txMin: 1, txMax: 100,
		faults:  map[string]int{"kill": 2, "sigstop": 1, "pg-restart": 1, "redis-kill": 1, "redis-stall": 1, "poison": 2},
		stopFor: 2 * time.Second, pauseFor: chaosPauseFor, pgDownFor: 500 * time.Millisecond, redisDownFor: 2 * time.Second,
		holdChance: 0.015, holdMin: time.Second, holdMax: 2 * time.Second}
}

// chaosPlanFromFlags is the plan of -chaos.full, with -chaos.rate,
// -chaos.window, -chaos.only and -chaos.each applied.
func chaosPlanFromFlags(t *testing.T) chaosPlan {
	t.Helper()
	plan := chaosPlanFor(*chaosFull)
	if *chaosRate > 0 {
		plan.rate = *chaosRate
	}
	if *chaosWindow > 0 {
		plan.window = *chaosWindow
		plan.deadline = max(plan.deadline, 2*plan.window+time.Minute)
	}
	if *chaosOnly != "" {
		only := make(map[string]int)
		for name := range strings.SplitSeq(*chaosOnly, ",") {
			name = strings.TrimSpace(name)
			if chaosFaultKind(name) == nil {
				t.Fatalf("-chaos.only: no fault %q (want some of %s)", name, strings.Join(chaosFaultNames(), ", "))
			}
			only[name] = cmp.Or(*chaosEach, plan.faults[name], 1)
		}
		plan.faults = only
		plan.name += " only " + *chaosOnly
	}
	return plan
}

// chaosFault is a kind of fault: its name (in -chaos.only and the
// figures), what it holds for (to schedule the faults over the window),
// and the controller's method that runs one.
type chaosFault struct {
	name string
	hold func(chaosPlan) time.Duration
	do   func(*chaos)
}

var chaosFaultKinds = []chaosFault{
	// SIGKILL the leader, start a new relay.
	{"kill", func(chaosPlan) time.Duration { return time.Second }, (*chaos).killLeader},
	// SIGSTOP the leader for stopFor while the standby takes over.
	{"sigstop", func(p chaosPlan) time.Duration { return p.stopFor }, (*chaos).stopLeader},
	// SIGSTOP every relay at once for pauseFor (a paused VM: nobody can
	// take over), then SIGCONT them all.
	{"pause-all", func(p chaosPlan) time.Duration { return p.pauseFor }, (*chaos).pauseAll},
	// Stop the standby (SIGTERM), SIGSTOP the leader for pauseFor with
	// nobody to take over, SIGCONT it, start a new standby.
	{"pause-solo", func(p chaosPlan) time.Duration { return p.pauseFor + time.Second }, (*chaos).pauseSolo},
	// Stop PostgreSQL (fast), start it pgDownFor later.
	{"pg-restart", func(p chaosPlan) time.Duration { return p.pgDownFor + time.Second }, (*chaos).restartPostgres},
	// SIGKILL Redis, start it on its port redisDownFor later.
	{"redis-kill", func(p chaosPlan) time.Duration { return p.redisDownFor + time.Second }, (*chaos).killRedis},
	// SIGSTOP Redis for redisStallFor (its clients' read timeout and
	// more), then SIGCONT it.
	{"redis-stall", func(p chaosPlan) time.Duration { return p.redisStallFor }, (*chaos).stallRedis},
	// A transaction with two rows the relay must dead-letter.
	{"poison", func(chaosPlan) time.Duration { return 0 }, (*chaos).plantPoison},
}

func chaosFaultKind(name string) *chaosFault {
	for i := range chaosFaultKinds {
		if chaosFaultKinds[i].name == name {
			return &chaosFaultKinds[i]
		}
	}
	return nil
}

func chaosFaultNames() []string {
	var names []string
	for _, k := range chaosFaultKinds {
		names = append(names, k.name)
	}
	return names
}

// relayReadTimeout is the read timeout of `stagedrain run`'s Redis client
// for url, after go-redis's defaults (5s in go-redis 9.23).
func relayReadTimeout(t *testing.T, url string) time.Duration {
	t.Helper()
	opts, err := runRedisOptions(url)
	if err != nil {
		t.Fatal(err)
	}
	rdb := redis.NewClient(opts) // dials nothing until used
	defer rdb.Close()
	return rdb.Options().ReadTimeout
}

// What the producers stage: jobs of these queues, some scheduled, in
// transactions of the plan's txMin to txMax jobs, some rolled back on
// purpose.
const (
	chaosRollbackChance   = 0.2
	chaosScheduledChance  = 0.1
	chaosWrongTypeQueue   = "chaos_wrongtype" // its key holds a string: LPUSH answers WRONGTYPE
	chaosMaxPayloadBytes  = 2048              // the relays' --max-payload-bytes
	chaosOversizedPadding = 3000              // bytes of padding in an oversized row
)

func chaosQueues() []string { return []string{"default", "critical", "mailers", "low"} }

// chaosLayout is where -chaos.target's jobs land: the list of a queue's
// immediate jobs, the sorted set of its scheduled ones (nil for a target
// that holds them in PostgreSQL until due, and pushes them to the list
// then), and how a scheduled job is staged.
type chaosLayout struct {
	target   string
	list     func(queue string) string
	schedule func(queue string) string
	runAt    string // SQL: a scheduled job's run_at
}

func chaosLayoutOf(t *testing.T) chaosLayout {
	switch *chaosTarget {
	case "sidekiq":
		return chaosLayout{target: "sidekiq", list: func(q string) string { return "queue:" + q },
			schedule: func(string) string { return "schedule" }, runAt: "now() + interval '1 hour'"}
	case "bullmq":
		// BullMQ's default prefix, bull: a queue's wait list and delayed set.
		return chaosLayout{target: "bullmq", list: func(q string) string { return "bull:" + q + ":wait" },
			schedule: func(q string) string { return "bull:" + q + ":delayed" }, runAt: "now() + interval '1 hour'"}
	case "celery":
		// Kombu's list of the queue (priority 0); due within the run.
		return chaosLayout{target: "celery", list: func(q string) string { return q },
			runAt: "now() + interval '3 seconds'"}
	}
	t.Fatalf("-chaos.target %q: want sidekiq, bullmq or celery", *chaosTarget)
	return chaosLayout{}
}

// scheduleKeys are the sorted sets of the queues' scheduled jobs, each once.
func (l chaosLayout) scheduleKeys() []string {
	var keys []string
	if l.schedule != nil {
		for _, q := range chaosQueues() {
			if k := l.schedule(q); !slices.Contains(keys, k) {
				keys = append(keys, k)
			}
		}
	}
	return keys
}

// queueOf returns the queue whose list key is, if it is one.
func (l chaosLayout) queueOf(key string) (string, bool) {
	for _, q := range append(chaosQueues(), chaosWrongTypeQueue) {
		if l.list(q) == key {
			return q, true
		}
	}
	return "", false
}

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
	seed := time.Now().UnixNano()
	c := newChaos(t, plan, seed, schemas)
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
	f := c.verdict()
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

// chaosFaultCounts is counts by fault name, in chaosFaultKinds' order:
// kill=12 sigstop=2 ...
func chaosFaultCounts(counts map[string]int) string {
	var parts []string
	for _, name := range chaosFaultNames() {
		if n, ok := counts[name]; ok {
			part := fmt.Sprintf("%s=%d", name, n)
			if aimed := counts[name+":aimed"]; aimed > 0 {
				part += fmt.Sprintf("(%d aimed)", aimed)
			}
			parts = append(parts, part)
		}
	}
	return strings.Join(parts, " ")
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

// chaosEvent is one fault, at its offset from the producers' start.
type chaosEvent struct {
	at    time.Duration
	fault *chaosFault
}

// schedule spreads the plan's faults over the window in a random order,
// one to a slot: each fault's slot is its hold plus an even share of the
// window's free time, and it starts at a random point of the first half
// of that share.
func (c *chaos) schedule() []chaosEvent {
	var kinds []*chaosFault
	var held time.Duration
	for i := range chaosFaultKinds {
		k := &chaosFaultKinds[i]
		for range c.plan.faults[k.name] {
			kinds = append(kinds, k)
			held += k.hold(c.plan)
		}
	}
	if len(kinds) == 0 {
		return nil
	}
	c.rng.Shuffle(len(kinds), func(i, j int) { kinds[i], kinds[j] = kinds[j], kinds[i] })
	free := max(c.plan.window-held, c.plan.window/10)
	share := free / time.Duration(len(kinds))
	events := make([]chaosEvent, len(kinds))
	var at time.Duration
	for i, k := range kinds {
		events[i] = chaosEvent{at: at + share/8 + time.Duration(c.rng.Int64N(int64(share/2))), fault: k}
		at += share + k.hold(c.plan)
	}
	return events
}

// pause waits d: the scenario's own pacing, not a synchronization.
func (c *chaos) pause(d time.Duration) bool { return pauseCtx(c.ctx, d) }

// leader waits until one of the live relays holds the leader lock, and
// returns its slot. In a fleet (-chaos.schemas) each relay leads a share
// of the schemas: the leader is the live relay that leads the most of
// them, once at least one does; on a tie (two relays with half each, the
// usual case) a random one of the two, so that kills in a row do not
// always strike the relay just started in the place of the last one.
func (c *chaos) leader() int {
	c.t.Helper()
	if c.fleet {
		return c.fleetLeader()
	}
	slot := -1
	relaytest.WaitFor(c.t, 30*time.Second, "a live relay to lead", func() (bool, string) {
		groups, err := admin.ReadGroups(c.ctx, c.db(), c.schemas[0])
		if err != nil {
			return false, err.Error()
		}
		if len(groups) == 0 || groups[0].Leader == nil {
			return false, "no session holds the leader lock"
		}
		l := groups[0].Leader // the relays of every queue: the only group
		for i, p := range c.live {
			if p.cmd.Process.Pid == l.PID {
				slot = i
				return true, ""
			}
		}
		return false, fmt.Sprintf("the lock is held by %q, not a live relay", l.ApplicationName)
	})
	return slot
}

// fleetLeadersSQL returns, for each schema of $1 whose leader lock (of
// every queue) a session holds, the pid in that session's application_name
// ("stagedrain leader <host>:<pid>"; 0 for another session).
const fleetLeadersSQL = `SELECT coalesce((regexp_match(a.application_name, '^stagedrain leader .*:([0-9]+)$'))[1]::int, 0)
	FROM unnest($1::text[]) AS s
	JOIN pg_locks l ON l.locktype = 'advisory' AND l.objsubid = 1 AND l.granted
	  AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
	  AND (l.classid::bigint << 32 | l.objid::bigint) = hashtextextended('stagedrain:' || s, 0)
	JOIN pg_stat_activity a ON a.pid = l.pid`

// led counts the schemas each live relay leads (by slot), and returns
// them with a description of who leads what.
func (c *chaos) led() (counts [2]int, others int, desc string, err error) {
	// One statement for every schema: the driver polls this, and each
	// read of pg_locks takes every lock partition, holding up the relays'
	// and the producers' own locks (admin.ReadGroups per schema, two reads
	// each, stalled delivery for 45s in a fleet of 20).
	rows, err := c.db().Query(c.ctx, fleetLeadersSQL, c.schemas)
	if err != nil {
		return counts, 0, "", err
	}
	pids, err := pgx.CollectRows(rows, pgx.RowTo[int])
	if err != nil {
		return counts, 0, "", err
	}
	for _, pid := range pids {
		i := slices.IndexFunc(c.live[:], func(p *proc) bool { return p != nil && p.cmd.Process.Pid == pid })
		if i < 0 {
			others++
			continue
		}
		counts[i]++
	}
	desc = fmt.Sprintf("of %d schemas, %d led by %s, %d by %s, %d by another session, %d by none",
		len(c.schemas), counts[0], c.liveName(0), counts[1], c.liveName(1), others, len(c.schemas)-len(pids))
	return counts, others, desc, nil
}

func (c *chaos) liveName(i int) string {
	if c.live[i] == nil {
		return "nobody"
	}
	return c.live[i].name
}

// waitLed waits until the counts of schemas the live relays lead satisfy
// ok.
func (c *chaos) waitLed(ok func(counts [2]int) bool, what string) {
	c.t.Helper()
	relaytest.WaitFor(c.t, 30*time.Second, what, func() (bool, string) {
		counts, _, desc, err := c.led()
		if err != nil {
			return false, err.Error()
		}
		return ok(counts), desc
	})
}

// waitBalanced waits until the two live relays lead every schema between
// them, each its share.
func (c *chaos) waitBalanced() {
	c.t.Helper()
	share := (len(c.schemas) + 1) / 2
	c.waitLed(func(counts [2]int) bool {
		return counts[0]+counts[1] == len(c.schemas) && counts[0] <= share && counts[1] <= share
	}, "the two relays to share the schemas")
}

// fleetLeader is leader in a fleet: the live relay that leads the most
// schemas.
func (c *chaos) fleetLeader() int {
	c.t.Helper()
	slot := -1
	relaytest.WaitFor(c.t, 30*time.Second, "a live relay to lead", func() (bool, string) {
		counts, _, desc, err := c.led()
		if err != nil {
			return false, err.Error()
		}
		if counts[0] == 0 && counts[1] == 0 {
			return false, desc
		}
		switch {
		case counts[0] > counts[1]:
			slot = 0
		case counts[1] > counts[0]:
			slot = 1
		default:
			slot = c.rng.IntN(2)
		}
		c.note("%s", desc)
		return true, ""
	})
	return slot
}

// killLeader SIGKILLs the leader and starts a new relay in its place.
func (c *chaos) killLeader() {
	c.t.Helper()
	i := c.leader()
	p := c.live[i]
	if err := p.cmd.Process.Kill(); err != nil {
		c.t.Fatalf("SIGKILL %s: %v", p.name, err)
	}
	c.note("SIGKILL %s, the leader", p.name)
	if code := p.wait(10 * time.Second); code != -1 {
		c.t.Errorf("%s exited with code %d, want death by SIGKILL", p.name, code)
	}
	c.live[i] = c.startRelay()
}

// stopLeader freezes the leader with SIGSTOP, and thaws it later.
func (c *chaos) stopLeader() {
	c.t.Helper()
	p := c.live[c.leader()]
	p.signal(syscall.SIGSTOP)
	c.note("SIGSTOP %s, the leader", p.name)
	c.pause(c.plan.stopFor)
	p.signal(syscall.SIGCONT)
	c.note("SIGCONT %s", p.name)
}

// pauseAll freezes every live relay at once with SIGSTOP, as a paused VM
// would (nobody is left to take over), and thaws them pauseFor later.
//
// Every other one (the first, the third...) is aimed (aimAtPush): it
// strikes while the leader's push script waits in Redis, which runs it
// once the relays are frozen. The leader wakes with the reply in its
// socket and its read deadline long past: Go's runtime hands it the
// reply or a timeout, whichever it sees first (a timeout about half the
// time here). Redis is let go before the relays thaw, not after: a relay
// that times out closes its connection, and Redis drops a paused
// client's command when the client goes.
func (c *chaos) pauseAll() {
	c.t.Helper()
	release := c.aim("pause-all")
	for _, p := range c.live {
		p.signal(syscall.SIGSTOP)
	}
	c.note("SIGSTOP %s and %s, every relay", c.live[0].name, c.live[1].name)
	release()
	c.pause(c.plan.pauseFor)
	for _, p := range c.live {
		p.signal(syscall.SIGCONT)
	}
	c.note("SIGCONT %s and %s", c.live[0].name, c.live[1].name)
}

// pauseSolo stops the standby (SIGTERM: it must exit 0), freezes the
// leader, alone now, with SIGSTOP, thaws it pauseFor later and starts a
// new standby. Every other one is aimed, as pauseAll's.
func (c *chaos) pauseSolo() {
	c.t.Helper()
	i := c.leader()
	lead, standby := c.live[i], c.live[1-i]
	standby.signal(syscall.SIGTERM)
	if code := standby.wait(20 * time.Second); code != 0 {
		c.t.Errorf("%s, the standby, exited with code %d after SIGTERM, want 0", standby.name, code)
	}
	c.note("SIGTERM %s, the standby: exited", standby.name)
	if c.fleet {
		// Alone, it takes the schemas the other led: every one, before
		// it is frozen with nobody to take over.
		c.waitLed(func(counts [2]int) bool { return counts[i] == len(c.schemas) }, lead.name+" to lead every schema alone")
		c.note("%s leads every schema", lead.name)
	}
	release := c.aim("pause-solo")
	lead.signal(syscall.SIGSTOP)
	c.note("SIGSTOP %s, the leader, alone", lead.name)
	release()
	c.pause(c.plan.pauseFor)
	lead.signal(syscall.SIGCONT)
	c.note("SIGCONT %s", lead.name)
	c.live[1-i] = c.startRelay()
}

// aim aims the odd-numbered faults of this kind (the first, the third...)
// at a push in flight (aimAtPush), counting those it aimed as
// "<fault>:aimed", and returns what ends the aiming once the fault has
// struck.
func (c *chaos) aim(fault string) (release func()) {
	if c.faults[fault]%2 == 0 {
		return func() {}
	}
	release, ok := c.aimAtPush()
	if ok {
		c.faults[fault+":aimed"]++
	}
	return release
}

// aimAtPush holds the next push in Redis, so that a SIGSTOP of the relays
// lands while the push is in flight: the leader has sent its script and
// waits for the reply, with its read deadline running. It pauses Redis's
// writes (CLIENT PAUSE WRITE: a script that may write waits, reads do not)
// and waits (up to chaosAimWait) until CLIENT LIST shows a relay's EVALSHA
// of a batch (over 1,000 bytes of arguments) held there; a smaller script
// held (a new leader taking the fence) is let through, and Redis paused
// again. It returns what unpauses Redis, which the caller calls once the
// relays are frozen (the pause ends by itself 2s after it began). ok is
// false, and Redis unpaused, if no push came.
func (c *chaos) aimAtPush() (release func(), ok bool) {
	c.t.Helper()
	unpause := func() {
		if err := c.rdb.Do(c.ctx, "CLIENT", "UNPAUSE").Err(); err != nil {
			c.t.Errorf("CLIENT UNPAUSE: %v", err)
		}
	}
	pause := func() bool {
		if err := c.rdb.Do(c.ctx, "CLIENT", "PAUSE", 2000, "WRITE").Err(); err != nil {
			c.t.Errorf("CLIENT PAUSE: %v", err)
			return false
		}
		return true
	}
	// held reports whether a relay's push script waits in Redis, and
	// whether another of its scripts does.
	held := func() (push, other bool) {
		list, err := c.rdb.ClientList(c.ctx).Result()
		if err != nil {
			return false, false
		}
		for line := range strings.SplitSeq(list, "\n") {
			f := strings.Fields(line)
			if !slices.Contains(f, "name=stagedrain") || !(slices.Contains(f, "cmd=evalsha") || slices.Contains(f, "cmd=eval")) ||
				!slices.ContainsFunc(f, func(s string) bool { return strings.HasPrefix(s, "flags=") && strings.Contains(s, "b") }) {
				continue
			}
			if slices.ContainsFunc(f, func(s string) bool {
				n, err := strconv.Atoi(strings.TrimPrefix(s, "argv-mem="))
				return strings.HasPrefix(s, "argv-mem=") && err == nil && n > 1000
			}) {
				return true, false
			}
			other = true
		}
		return false, other
	}
	if !pause() {
		return func() {}, false
	}
	tick := time.NewTicker(2 * time.Millisecond)
	defer tick.Stop()
	deadline := time.Now().Add(chaosAimWait)
	for {
		push, other := held()
		if push {
			break
		}
		if other {
			unpause()
			if !pause() {
				return func() {}, false
			}
		}
		if time.Now().After(deadline) {
			unpause()
			c.note("aim: no push came within %s of CLIENT PAUSE WRITE; not aimed", chaosAimWait)
			return func() {}, false
		}
		select {
		case <-tick.C:
		case <-c.ctx.Done():
			return func() {}, false
		}
	}
	c.note("aim: a push script held in Redis (CLIENT PAUSE WRITE)")
	return func() {
		unpause()
		c.note("aim: CLIENT UNPAUSE")
	}, true
}

// chaosAimWait is how long aimAtPush waits for a push to come.
const chaosAimWait = time.Second

func (c *chaos) restartPostgres() {
	c.t.Helper()
	c.pg.Stop()
	c.note("PostgreSQL stopped")
	c.pause(c.plan.pgDownFor)
	c.pg.Start()
	c.note("PostgreSQL started")
}

func (c *chaos) killRedis() {
	c.t.Helper()
	c.redis.Stop()
	c.note("Redis killed")
	c.pause(c.plan.redisDownFor)
	c.redis.Start()
	c.note("Redis started")
}

// stallRedis freezes Redis with SIGSTOP for redisStallFor, longer than
// the relays' read timeout, and thaws it: what a client sent meanwhile
// (and what it sent again after a timeout) runs once it thaws.
func (c *chaos) stallRedis() {
	c.t.Helper()
	c.redis.Signal(syscall.SIGSTOP)
	c.note("SIGSTOP Redis")
	c.pause(c.plan.redisStallFor)
	c.redis.Signal(syscall.SIGCONT)
	c.note("SIGCONT Redis")
}

// plantPoison commits a transaction with two rows the relay must
// dead-letter (a payload over --max-payload-bytes; a job for a queue whose
// key holds a string) between ordinary jobs.
func (c *chaos) plantPoison() {
	c.t.Helper()
	n := c.faults["poison"] // this one counted already
	tx := &chaosTx{id: fmt.Sprintf("poison.%d", n), commit: true, schema: c.schemas[0]}
	if c.fleet {
		tx.schema = c.schemas[c.rng.IntN(len(c.schemas))]
	}
	tx.add("default", false, "")
	tx.add("default", false, "oversize")
	tx.add("critical", false, "")
	tx.add(chaosWrongTypeQueue, false, "wrongtype")
	tx.add("mailers", false, "")
	err := c.sql[tx.schema].run(c.ctx, c.db(), tx)
	c.note("planted %s in %s: %s (%v)", tx.id, tx.schema, tx.outcome, err)
	c.txs = append(c.txs, tx)
}

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

// deliveryGap is the longest time the number of jobs in Redis stood still
// between two increases, and when that gap ended.
type deliveryGap struct {
	longest time.Duration
	endedAt time.Time
	spans   []gapSpan // every gap of a second or more
}

type gapSpan struct{ from, to time.Time }

// unplanned returns the longest time delivery stood still outside the
// faults' own windows (from a fault's start to its end: a SIGSTOP's or a
// stall's hold, a server's restart), and when that gap ended. A plan can
// line up stalls back to back (8s of every relay stopped, then 8s more,
// then Redis stopped twice for 7s: 30s in which nothing can be
// delivered); what is left of a gap outside them is the time the relays
// took to recover, which is what the verdict bounds.
func (g deliveryGap) unplanned(ran []chaosRun) (longest time.Duration, endedAt time.Time) {
	for _, s := range g.spans {
		left := s.to.Sub(s.from)
		// The faults' windows inside the gap, merged where they overlap.
		var ws []gapSpan
		for _, r := range ran {
			if r.fault == "poison" {
				continue
			}
			from, to := r.from, r.to
			if from.Before(s.from) {
				from = s.from
			}
			if to.After(s.to) {
				to = s.to
			}
			if from.Before(to) {
				ws = append(ws, gapSpan{from, to})
			}
		}
		slices.SortFunc(ws, func(a, b gapSpan) int { return a.from.Compare(b.from) })
		var covered time.Duration
		var end time.Time
		for _, w := range ws {
			if w.from.Before(end) {
				w.from = end
			}
			if w.from.Before(w.to) {
				covered += w.to.Sub(w.from)
				end = w.to
			}
		}
		if left -= covered; left > longest {
			longest, endedAt = left, s.to
		}
	}
	return longest, endedAt
}

// sampleDeliveries counts the jobs in the queues and the schedule every
// 20ms until ctx ends (errors, Redis down, count as no change).
func sampleDeliveries(ctx context.Context, port int, layout chaosLayout) deliveryGap {
	rdb := redis.NewClient(&redis.Options{Addr: fmt.Sprintf("127.0.0.1:%d", port), DisableIdentity: true,
		MaxRetries: -1, DialTimeout: 200 * time.Millisecond, ReadTimeout: 500 * time.Millisecond, PoolSize: 1})
	defer rdb.Close()
	var g deliveryGap
	var last int64
	var lastUp time.Time
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return g
		case <-tick.C:
		}
		var cmds []*redis.IntCmd
		_, err := rdb.Pipelined(ctx, func(p redis.Pipeliner) error {
			for _, q := range chaosQueues() {
				cmds = append(cmds, p.LLen(ctx, layout.list(q)))
			}
			for _, k := range layout.scheduleKeys() {
				cmds = append(cmds, p.ZCard(ctx, k))
			}
			return nil
		})
		if err != nil {
			continue
		}
		var n int64
		for _, cmd := range cmds {
			n += cmd.Val()
		}
		if now := time.Now(); n > last {
			gap := now.Sub(lastUp)
			if !lastUp.IsZero() && gap > g.longest {
				g.longest, g.endedAt = gap, now
			}
			if !lastUp.IsZero() && gap >= time.Second {
				g.spans = append(g.spans, gapSpan{lastUp, now})
			}
			last, lastUp = n, now
		}
	}
}

// delivery is one job found in Redis.
type delivery struct {
	key      string // queue:<name> or schedule
	jid      string
	enqueued time.Time // when the relay pushed it (enqueued_at; zero for a scheduled job)
}

func (d delivery) String() string {
	if d.enqueued.IsZero() {
		return d.key + " jid " + d.jid
	}
	return d.key + " jid " + d.jid + " enqueued " + d.enqueued.Format("15:04:05.000")
}

// chaosReadScript reads ARGV[1] to ARGV[2] of the list (ARGV[3] "list")
// or zset KEYS[1] and decodes each entry in Redis (cjson: a million
// payloads decode in seconds there, in minutes in a -race test binary):
// "marker TAB jid TAB queue TAB enqueued_at" for a chaos job (enqueued_at
// "" when the payload has none), "!" and the raw entry (its newlines as
// \n) for anything else. It answers how many entries it read, and their
// lines joined by newlines: one reply to parse, not one per entry.
var chaosReadScript = redis.NewScript(`
local items
if ARGV[3] == 'list' then
  items = redis.call('LRANGE', KEYS[1], ARGV[1], ARGV[2])
else
  items = redis.call('ZRANGE', KEYS[1], ARGV[1], ARGV[2])
end
local out = {}
for i, raw in ipairs(items) do
  local ok, job = pcall(cjson.decode, raw)
  local marker = ok and type(job) == 'table' and job.class == 'ChaosJob' and type(job.args) == 'table' and job.args[1]
  if type(marker) == 'string' and marker ~= '' and type(job.queue) == 'string' and type(job.jid) == 'string' and
     not (marker .. job.queue .. job.jid):find('[\t\n]') then
    local at = ''
    if type(job.enqueued_at) == 'number' then at = string.format('%.6f', job.enqueued_at) end
    out[i] = marker .. '\t' .. job.jid .. '\t' .. job.queue .. '\t' .. at
  else
    out[i] = '!' .. raw:gsub('\n', '\\n')
  end
end
return {#items, table.concat(out, '\n')}
`)

// chaosReadCeleryScript is chaosReadScript for Celery's task messages
// (-chaos.target celery): the marker is the first of the args, read from
// the headers' argsrepr (the args' JSON text; the body is the same text in
// base64, which the real-worker and golden tests check), the jid the
// task id, the queue delivery_info's routing_key; enqueued_at is "".
var chaosReadCeleryScript = redis.NewScript(`
local items = redis.call('LRANGE', KEYS[1], ARGV[1], ARGV[2])
local out = {}
for i, raw in ipairs(items) do
  local ok, m = pcall(cjson.decode, raw)
  local h = ok and type(m) == 'table' and m.headers
  local p = ok and type(m) == 'table' and m.properties
  local marker, queue, jid
  if type(h) == 'table' and h.task == 'ChaosJob' and type(h.argsrepr) == 'string' and type(p) == 'table' and
     type(p.delivery_info) == 'table' then
    local ok2, args = pcall(cjson.decode, h.argsrepr)
    marker = ok2 and type(args) == 'table' and args[1]
    queue, jid = p.delivery_info.routing_key, h.id
  end
  if type(marker) == 'string' and marker ~= '' and type(queue) == 'string' and type(jid) == 'string' and
     not (marker .. queue .. jid):find('[\t\n]') then
    out[i] = marker .. '\t' .. jid .. '\t' .. queue .. '\t'
  else
    out[i] = '!' .. raw:gsub('\n', '\\n')
  end
end
return {#items, table.concat(out, '\n')}
`)

// readDeliveries reads every job of Sidekiq's keys (the queue:* lists and
// the schedule zset; any other key, such as the relay's own bookkeeping,
// is not a delivery) by marker. Entries that are not a chaos job, and
// queue keys that are not lists (but the WRONGTYPE one), are returned as
// foreign.
func (c *chaos) readDeliveries() (map[string][]delivery, []string) {
	t, ctx := c.t, c.ctx
	byMarker := make(map[string][]delivery, c.plan.committed()+c.plan.committed()/8)
	var foreign []string
	add := func(key, entry string) {
		if raw, ok := strings.CutPrefix(entry, "!"); ok {
			foreign = append(foreign, key+": "+raw)
			return
		}
		marker, rest, ok1 := strings.Cut(entry, "\t")
		jid, rest, ok2 := strings.Cut(rest, "\t")
		queue, at, ok3 := strings.Cut(rest, "\t")
		if !ok1 || !ok2 || !ok3 {
			foreign = append(foreign, key+": "+entry)
			return
		}
		if q, ok := c.layout.queueOf(key); ok && queue != q {
			foreign = append(foreign, key+": queue "+queue+": "+marker+" jid "+jid)
			return
		}
		d := delivery{key: key, jid: jid}
		if at != "" {
			secs, err := strconv.ParseFloat(at, 64)
			if err != nil {
				t.Fatalf("%s: enqueued_at %q: %v", key, at, err)
			}
			if secs > 0 {
				d.enqueued = time.Unix(0, int64(secs*1e9))
			}
		}
		byMarker[marker] = append(byMarker[marker], d)
	}
	const chunk = 10_000
	read := func(key, kind string) {
		for i := int64(0); ; i += chunk {
			script := chaosReadScript
			if c.layout.target == "celery" {
				script = chaosReadCeleryScript
			}
			reply, err := script.Run(ctx, c.rdb, []string{key}, i, i+chunk-1, kind).Slice()
			if err != nil {
				t.Fatalf("read %s %s: %v", kind, key, err)
			}
			n, _ := reply[0].(int64)
			lines, _ := reply[1].(string)
			for got := int64(0); got < n; got++ {
				var entry string
				entry, lines, _ = strings.Cut(lines, "\n")
				add(key, entry)
			}
			if n < chunk {
				break
			}
		}
	}
	if c.layout.target == "bullmq" {
		c.readBullmqDeliveries(add)
		return byMarker, foreign
	}
	pattern := c.layout.list("*")
	keys, err := c.rdb.Keys(ctx, pattern).Result()
	if err != nil {
		t.Fatalf("KEYS %s: %v", pattern, err)
	}
	for _, key := range keys {
		if c.layout.target == "celery" && (strings.HasPrefix(key, "stagedrain:") || strings.HasPrefix(key, "_kombu.")) {
			continue // the relay's own keys (and no worker's) share the key space with Kombu's lists
		}
		typ, err := c.rdb.Type(ctx, key).Result()
		if err != nil {
			t.Fatalf("TYPE %s: %v", key, err)
		}
		switch {
		case typ == "list":
			read(key, "list")
		case key == c.layout.list(chaosWrongTypeQueue) && typ == "string":
		default:
			foreign = append(foreign, fmt.Sprintf("%s: a %s", key, typ))
		}
	}
	for _, k := range c.layout.scheduleKeys() {
		read(k, "zset")
	}
	return byMarker, foreign
}

// chaosBullmqReadScript reads ARGV[1] to ARGV[2] of the wait list (ARGV[3]
// "list") or delayed zset KEYS[1] of the BullMQ queue whose keys start
// KEYS[2] (bull:<queue>:), as chaosReadScript does Sidekiq's: each entry is
// a job id, its job hash <prefix><id> holds the name and data (whose first
// element is the marker). The queue is the key's.
var chaosBullmqReadScript = redis.NewScript(`
local items
if ARGV[3] == 'list' then
  items = redis.call('LRANGE', KEYS[1], ARGV[1], ARGV[2])
else
  items = redis.call('ZRANGE', KEYS[1], ARGV[1], ARGV[2])
end
local out = {}
for i, id in ipairs(items) do
  local h = redis.call('HMGET', KEYS[2] .. id, 'name', 'data')
  local ok, data = pcall(cjson.decode, h[2] or '')
  local marker = ok and h[1] == 'ChaosJob' and type(data) == 'table' and data[1]
  if type(marker) == 'string' and marker ~= '' and not (marker .. id):find('[\t\n]') then
    out[i] = marker .. '\t' .. id .. '\t' .. ARGV[4] .. '\t'
  else
    out[i] = '!' .. id .. ' ' .. tostring(h[1]) .. ' ' .. tostring(h[2])
  end
end
return {#items, table.concat(out, '\n')}
`)

// readBullmqDeliveries reads every job of the BullMQ queues' wait lists
// and delayed sets into add. The job
// key guards a BullMQ add, so a second push of a job is a no-op there: the
// queues' job counters (<prefix>:<queue>:id, one INCR per add that ran)
// must then add up to the jobs found, or a job was added twice.
func (c *chaos) readBullmqDeliveries(add func(key, entry string)) {
	t, ctx := c.t, c.ctx
	const chunk = 10_000
	var found, adds int64
	for _, q := range chaosQueues() {
		for _, kind := range []string{"list", "zset"} {
			key := c.layout.list(q)
			if kind == "zset" {
				key = c.layout.schedule(q)
			}
			for i := int64(0); ; i += chunk {
				reply, err := chaosBullmqReadScript.Run(ctx, c.rdb, []string{key, "bull:" + q + ":"}, i, i+chunk-1, kind, q).Slice()
				if err != nil {
					t.Fatalf("read %s %s: %v", kind, key, err)
				}
				n, _ := reply[0].(int64)
				lines, _ := reply[1].(string)
				for got := int64(0); got < n; got++ {
					var entry string
					entry, lines, _ = strings.Cut(lines, "\n")
					add(key, entry)
				}
				found += n
				if n < chunk {
					break
				}
			}
		}
		n, err := c.rdb.Get(ctx, "bull:"+q+":id").Int64()
		if err != nil && !errors.Is(err, redis.Nil) {
			t.Fatalf("GET bull:%s:id: %v", q, err)
		}
		adds += n
	}
	if adds != found {
		t.Errorf("BullMQ's job counters count %d adds, for %d jobs in the queues: a job was added twice", adds, found)
	}
	c.note("bullmq: %d jobs found, %d adds counted", found, adds)
}

// readDead returns the markers of staged_jobs_dead's rows (of every
// schema), each with its reason and attempts; in a fleet, "in <schema>"
// before them.
func (c *chaos) readDead() map[string]string {
	rows, err := c.db().Query(c.ctx, c.tables("staged_jobs_dead", "job_args->>0, reason, attempts", true))
	if err != nil {
		c.t.Fatalf("read staged_jobs_dead: %v", err)
	}
	dead := make(map[string]string)
	var schema, marker, reason string
	var attempts int
	_, err = pgx.ForEachRow(rows, []any{&schema, &marker, &reason, &attempts}, func() error {
		if _, twice := dead[marker]; twice {
			return fmt.Errorf("%s dead-lettered twice (again in %s)", marker, schema)
		}
		dead[marker] = c.deadReason(schema, attempts, reason)
		return nil
	})
	if err != nil {
		c.t.Fatalf("read staged_jobs_dead: %v", err)
	}
	return dead
}

// deadReason is what readDead says of a dead row: "attempts 1: reason",
// after "in <schema>: " in a fleet.
func (c *chaos) deadReason(schema string, attempts int, reason string) string {
	s := fmt.Sprintf("attempts %d: %s", attempts, reason)
	if c.fleet {
		s = "in " + schema + ": " + s
	}
	return s
}

// readLedger returns the ids of the transactions that committed (in every
// schema).
func (c *chaos) readLedger() map[string]bool {
	rows, err := c.db().Query(c.ctx, c.tables("chaos_ledger", "tx", false))
	if err != nil {
		c.t.Fatalf("read the ledger: %v", err)
	}
	ids, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		c.t.Fatalf("read the ledger: %v", err)
	}
	committed := make(map[string]bool, len(ids))
	for _, id := range ids {
		committed[id] = true
	}
	return committed
}

// chaosFigures is what a run found; check judges it.
type chaosFigures struct {
	plan    string
	seed    int64
	rate    int
	window  time.Duration
	elapsed time.Duration

	txs, txsCommitted, txsRolledBack, txsFailed int
	inDoubt, inDoubtCommitted                   int // transactions whose COMMIT failed in flight, and of those, committed
	committed, rolledBack                       int // jobs (poison aside)

	delivered           int // entries of chaos jobs in Redis
	lost                int // committed jobs not in Redis
	duplicates          int // entries beyond the first of a committed job's jid (or of the job, under another jid)
	duplicatedJobs      int // committed jobs in Redis more than once
	rejids              int // entries of a committed job under a jid other than its first: pushed again as a new job
	rolledBackDelivered int // entries of jobs that never committed
	unstaged            int // entries of chaos jobs that no producer staged
	misplaced           int // entries of a job in the wrong queue, or scheduled when not (or not when)

	planted   int // poison rows committed
	dead      int // rows in staged_jobs_dead
	deadWrong []string

	stagedLeft    int
	leaderChanges int // relays that became leader after the first
	faults        map[string]int
	gap           deliveryGap
	gapAt         time.Duration // when the longest gap ended, from the producers' start
	unplanned     time.Duration // the longest gap outside the faults' windows (deliveryGap.unplanned)
	unplannedAt   time.Duration // when it ended, from the producers' start

	duplicateCauses []string       // duplicates grouped by when they were pushed
	duplicatesBy    map[string]int // duplicates by the fault under way when the job was first pushed ("none": no fault)

	ledgerWrong []string // a transaction whose outcome the ledger contradicts
	foreign     []string // entries in Redis that are no chaos job, or keys of the wrong type
	samples     map[string][]string
}

func (f *chaosFigures) sample(kind, s string) {
	if len(f.samples[kind]) < 10 {
		f.samples[kind] = append(f.samples[kind], s)
	}
}

// verdict stops the relays (SIGTERM: each must exit 0) and gathers the
// figures from the producers' records, the ledger, Redis and PostgreSQL.
func (c *chaos) verdict() *chaosFigures {
	t := c.t
	f := &chaosFigures{plan: c.plan.name, seed: c.seed, rate: c.plan.rate, window: c.plan.window,
		faults: c.faults, gap: c.gap, samples: make(map[string][]string)}
	if !c.gap.endedAt.IsZero() {
		f.gapAt = c.gap.endedAt.Sub(c.start)
		var at time.Time
		if f.unplanned, at = c.gap.unplanned(c.ran); !at.IsZero() {
			f.unplannedAt = at.Sub(c.start)
		}
	}
	// A relay started by the last fault may not have installed its signal
	// handler yet (it does before its first line, "starting"), and would
	// die of the signal: wait for that line first.
	for _, p := range c.live {
		relaytest.WaitFor(t, 30*time.Second, p.name+" to log starting", func() (bool, string) {
			return p.count(rootLogger, "starting") > 0, "no starting line yet"
		})
	}
	for _, p := range c.live {
		p.signal(syscall.SIGTERM)
	}
	for _, p := range c.live {
		if code := p.wait(20 * time.Second); code != 0 {
			t.Errorf("%s exited with code %d after SIGTERM, want 0", p.name, code)
		}
	}
	f.elapsed = time.Since(c.start)
	for _, p := range c.relays {
		f.leaderChanges += p.count(rootLogger, "became leader")
	}
	f.leaderChanges -= len(c.schemas) // the first leader (of each schema)

	c.note("relays stopped")
	ledger := c.readLedger()
	deliveries, foreign := c.readDeliveries()
	c.note("read %d jobs' entries from Redis", len(deliveries))
	f.foreign = foreign
	dead := c.readDead()
	f.dead = len(dead)
	var err error
	if f.stagedLeft, err = c.staged(); err != nil {
		t.Fatalf("count staged_jobs: %v", err)
	}

	var dups [][]delivery
	for _, tx := range c.txs {
		f.txs++
		committed := ledger[tx.id]
		switch tx.outcome {
		case txCommitted:
			f.txsCommitted++
			if !committed {
				f.ledgerWrong = append(f.ledgerWrong, tx.id+": COMMIT succeeded, but its ledger row is gone")
			}
		case txRolledBack, txFailed:
			if tx.outcome == txRolledBack {
				f.txsRolledBack++
			} else {
				f.txsFailed++
			}
			if committed {
				f.ledgerWrong = append(f.ledgerWrong, tx.id+": "+tx.outcome.String()+", but its ledger row is there")
			}
		case txInDoubt:
			f.inDoubt++
			if committed {
				f.inDoubtCommitted++
			}
		}
		for _, j := range tx.jobs {
			got := deliveries[j.marker]
			delete(deliveries, j.marker)
			f.delivered += len(got)
			want := c.layout.list(j.queue)
			if j.scheduled && c.layout.schedule != nil {
				want = c.layout.schedule(j.queue)
			}
			for _, d := range got {
				if d.key != want {
					f.misplaced++
					f.sample("misplaced", fmt.Sprintf("%s in %s, want %s", j.marker, d.key, want))
				}
			}
			switch {
			case j.poison != "":
				if committed {
					f.planted++
					reason, ok := dead[j.marker]
					delete(dead, j.marker)
					wantReason := map[string]string{"oversize": "over the limit", "wrongtype": "WRONGTYPE"}[j.poison]
					if want := c.deadReason(tx.schema, 1, ""); !ok || !strings.HasPrefix(reason, want) || !strings.Contains(reason, wantReason) {
						f.deadWrong = append(f.deadWrong, fmt.Sprintf("planted %s (%s): dead row %q, want %q and a reason with %q", j.marker, j.poison, reason, want, wantReason))
					}
				}
				if len(got) > 0 {
					f.deadWrong = append(f.deadWrong, fmt.Sprintf("planted %s (%s) is in Redis %d times", j.marker, j.poison, len(got)))
				}
			case committed:
				f.committed++
				switch {
				case len(got) == 0:
					f.lost++
					f.sample("lost", fmt.Sprintf("%s (transaction %s)", j.marker, tx.outcome))
				case len(got) > 1:
					// Exactly: every entry beyond the first of the job's
					// jid is a duplicate, and so is an entry of the job
					// under any other jid.
					f.duplicates += len(got) - 1
					f.duplicatedJobs++
					for _, d := range got[1:] {
						if d.jid != got[0].jid {
							f.rejids++
						}
					}
					f.sample("duplicate", fmt.Sprintf("%s x%d %v", j.marker, len(got), got))
					dups = append(dups, got)
				}
			default:
				f.rolledBack++
				if len(got) > 0 {
					f.rolledBackDelivered += len(got)
					f.sample("rolled back delivered", fmt.Sprintf("%s (transaction %s) %v", j.marker, tx.outcome, got))
				}
			}
		}
	}
	for marker, got := range deliveries {
		f.unstaged += len(got)
		f.foreign = append(f.foreign, fmt.Sprintf("%s: no such job staged, delivered %v", marker, got))
	}
	for marker, reason := range dead {
		f.deadWrong = append(f.deadWrong, fmt.Sprintf("%s in staged_jobs_dead (%s), never planted", marker, reason))
	}
	slices.Sort(f.deadWrong)
	f.duplicateCauses, f.duplicatesBy = c.duplicateCauses(dups)
	c.note("figures done")
	return f
}

// duplicateCauses groups duplicated jobs by when they were pushed first and
// last (to 10ms), naming what the timeline holds in between, and counts
// the duplicate entries by the fault under way when the job was first
// pushed: one that started at most chaosBlameBefore later (a push in flight
// when it struck) or ended at most chaosBlameAfter earlier.
func (c *chaos) duplicateCauses(dups [][]delivery) ([]string, map[string]int) {
	type span struct{ first, last time.Time }
	count := make(map[span]int)
	entries := make(map[span]int)
	for _, got := range dups {
		var sp span
		for _, d := range got {
			if d.enqueued.IsZero() {
				continue
			}
			if t := d.enqueued.Truncate(10 * time.Millisecond); sp.first.IsZero() || t.Before(sp.first) {
				sp.first = t
			}
			if t := d.enqueued.Truncate(10 * time.Millisecond); t.After(sp.last) {
				sp.last = t
			}
		}
		count[sp]++
		entries[sp] += len(got) - 1
	}
	spans := slices.SortedFunc(maps.Keys(count), func(a, b span) int { return a.first.Compare(b.first) })
	var out []string
	by := make(map[string]int)
	for _, sp := range spans {
		blamed := "none"
		for _, r := range c.ran {
			if !sp.first.Before(r.from.Add(-chaosBlameBefore)) && !sp.first.After(r.to.Add(chaosBlameAfter)) {
				blamed = r.fault
				break
			}
		}
		by[blamed] += entries[sp]
		out = append(out, fmt.Sprintf("%d jobs pushed at %s and again at %s (during %s), in between: %s",
			count[sp], c.offset(sp.first), c.offset(sp.last), blamed, strings.Join(c.between(sp.first, sp.last.Add(10*time.Millisecond)), "; ")))
	}
	return out, by
}

// A duplicate is blamed on a fault that started up to chaosBlameBefore
// after the job's first push (its enqueued_at, set as the batch was built:
// the fault struck the push in flight) or ended up to chaosBlameAfter
// before it.
const (
	chaosBlameBefore = time.Second
	chaosBlameAfter  = 100 * time.Millisecond
)

// chaosBlameCounts is duplicatesBy as redis-stall=27 pause-all=300, in
// chaosFaultKinds' order, "none" last; "-" when there are none.
func chaosBlameCounts(by map[string]int) string {
	var parts []string
	for _, name := range append(chaosFaultNames(), "none") {
		if n := by[name]; n > 0 {
			parts = append(parts, fmt.Sprintf("%s=%d", name, n))
		}
	}
	if len(parts) == 0 {
		return "-"
	}
	return strings.Join(parts, " ")
}

// phantom is the entries in Redis of chaos jobs that never committed:
// rolled back, failed, or never staged at all.
func (f *chaosFigures) phantom() int { return f.rolledBackDelivered + f.unstaged }

// summary is the run's figures on one line, the faults last (as many of
// each kind as ran).
func (f *chaosFigures) summary() string {
	return fmt.Sprintf("chaos %s seed=%d rate=%d/s window=%s: committed=%d delivered=%d lost=%d duplicates=%d duplicated_jobs=%d phantom=%d "+
		"rolled_back=%d in_doubt_txs=%d(%d committed) misplaced=%d dead=%d planted=%d staged_left=%d leader_changes=%d "+
		"longest_gap=%.2fs(ended +%.1fs) elapsed=%.1fs duplicates_by_fault: %s faults: %s",
		f.plan, f.seed, f.rate, f.window, f.committed, f.delivered, f.lost, f.duplicates, f.duplicatedJobs, f.phantom(),
		f.rolledBack, f.inDoubt, f.inDoubtCommitted, f.misplaced, f.dead, f.planted, f.stagedLeft, f.leaderChanges,
		f.gap.longest.Seconds(), f.gapAt.Seconds(), f.elapsed.Seconds(), chaosBlameCounts(f.duplicatesBy), chaosFaultCounts(f.faults))
}

func (f *chaosFigures) log(t *testing.T) {
	t.Helper()
	t.Logf("transactions: %d (%d committed, %d rolled back on purpose, %d failed before COMMIT, %d in doubt of which %d committed)",
		f.txs, f.txsCommitted, f.txsRolledBack, f.txsFailed, f.inDoubt, f.inDoubtCommitted)
	t.Logf("jobs committed: %d; rolled back or never committed: %d; delivered (entries in Redis): %d", f.committed, f.rolledBack, f.delivered)
	t.Logf("lost: %d; duplicates: %d (of %d jobs; %d under a jid of their own); phantom: %d (%d rolled back or failed, %d never staged); misplaced: %d",
		f.lost, f.duplicates, f.duplicatedJobs, f.rejids, f.phantom(), f.rolledBackDelivered, f.unstaged, f.misplaced)
	if len(f.duplicateCauses) > 0 {
		t.Logf("duplicates by when they were pushed (scheduled jobs pushed twice do not show: the schedule zset holds one copy):\n  %s", strings.Join(f.duplicateCauses, "\n  "))
	}
	t.Logf("dead letters: %d (planted %d); left staged: %d", f.dead, f.planted, f.stagedLeft)
	t.Logf("faults: %s; leader changes: %d", chaosFaultCounts(f.faults), f.leaderChanges)
	t.Logf("longest gap in delivery: %s (ended %.1fs after the producers started); outside the faults' windows: %s (ended %.1fs); elapsed: %s",
		f.gap.longest.Round(time.Millisecond), f.gapAt.Seconds(), f.unplanned.Round(time.Millisecond), f.unplannedAt.Seconds(), f.elapsed.Round(time.Millisecond))
	t.Log(f.summary())
}

// check fails the test for whatever the figures show went wrong.
func (f *chaosFigures) check(t *testing.T) {
	t.Helper()
	if f.lost != 0 {
		t.Errorf("%d committed jobs never reached Redis, want none; some: %v", f.lost, f.samples["lost"])
	}
	checkExactlyOnce(t, f)
	if f.rolledBackDelivered != 0 {
		t.Errorf("%d entries in Redis of jobs that never committed, want none; some: %v", f.rolledBackDelivered, f.samples["rolled back delivered"])
	}
	if f.misplaced != 0 {
		t.Errorf("%d jobs in the wrong queue or schedule; some: %v", f.misplaced, f.samples["misplaced"])
	}
	if len(f.foreign) != 0 {
		t.Errorf("%d entries in Redis that no producer staged (or keys of the wrong type), want none; some: %v", len(f.foreign), f.foreign[:min(10, len(f.foreign))])
	}
	if f.stagedLeft != 0 {
		t.Errorf("%d rows left in staged_jobs, want none", f.stagedLeft)
	}
	if (f.faults["poison"] > 0 && f.planted == 0) || f.dead != f.planted || len(f.deadWrong) != 0 {
		t.Errorf("staged_jobs_dead holds %d rows, want exactly the %d planted (and some planted); wrong: %v", f.dead, f.planted, f.deadWrong)
	}
	if len(f.ledgerWrong) != 0 {
		t.Errorf("the ledger contradicts what the producers saw: %v", f.ledgerWrong)
	}
	// Faults stall delivery for their whole hold (a SIGSTOP of every
	// relay, Redis stopped), and a plan may line several up; outside them,
	// a relay that stays stuck this long is not recovering on its own.
	if f.unplanned > 30*time.Second {
		t.Errorf("delivery stood still for %s outside the faults' windows (longest gap %s), want under 30s", f.unplanned, f.gap.longest)
	}
}

// checkExactlyOnce is the exactly-once assertion: no committed job in Redis
// twice (the same jid pushed again after a fault). Everything else (none
// lost, none delivered after a rollback) is checked apart, so a run shows
// duplicates as a figure of their own.
func checkExactlyOnce(t *testing.T, f *chaosFigures) {
	t.Helper()
	if f.duplicates != 0 {
		t.Errorf("%d duplicate entries of committed jobs in Redis, want none (exactly once); some: %v", f.duplicates, f.samples["duplicate"])
	}
}
