package relay

import (
	"context"
	"fmt"
	"os"
	"slices"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/stagedrain/stagedrain/relay/internal/testenv"
)

// The fleet's poll finds the schemas with rows staged, in one statement
// that PostgreSQL plans once: prepared on the pool's session, and built
// again only when the schemas led change. Planning a union over 200
// schemas took 13.8 ms a poll where running it prepared takes 1.8 ms, and
// a hot fleet polls hundreds of times a second. Its hot polls list the
// schemas led in one order: in a map's, each poll was a new statement.
func TestFleetPollIsPrepared(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	r, led, conn := pollTenants(t, "fpoll", []string{"a", "b", "c"})
	if _, err := NewStager(led[1].schema).Stage(ctx, conn, Job{Name: "W"}); err != nil {
		t.Fatal(err)
	}
	s, pool := pollSession(t, r)

	woken := func() (names []string) {
		for _, l := range led {
			select {
			case <-l.wake:
				names = append(names, l.schema)
			default:
			}
		}
		return names
	}
	for range 3 {
		if n, err := s.poll(ctx, led, true); err != nil || n != 1 {
			t.Fatalf("the poll found %d schemas with rows, want 1 (%s); error: %v", n, led[1].schema, err)
		}
		if got := woken(); !slices.Equal(got, []string{led[1].schema}) {
			t.Fatalf("the poll woke %v, want %s only", got, led[1].schema)
		}
	}
	first := s.pollSQL[0]
	s.poll(ctx, led[:2], true)
	if s.pollSQL[0] == first {
		t.Fatal("the poll's statement was not rebuilt for other schemas led")
	}
	second := s.pollSQL[0]
	woken()

	// The session's own list of the schemas it leads, as its hot polls
	// take it: the same statement every time (a map's order changes at
	// every range).
	for _, l := range led {
		l.leading = true
		r.fleet.tenants[l.schema] = l
	}
	for range 20 {
		s.poll(ctx, s.led(), true)
		woken()
	}
	if len(s.pollSQL) != 1 || s.pollSQL[0] != first {
		t.Fatalf("the poll over every schema led is %q, want %q (the schemas in order)", s.pollSQL, first)
	}

	c, err := pool.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Release()
	rows, err := c.Query(ctx, `SELECT statement FROM pg_prepared_statements WHERE statement LIKE 'SELECT 0, id FROM (SELECT id FROM %'`)
	if err != nil {
		t.Fatal(err)
	}
	prepared, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	// One statement per set of schemas led, each prepared once for all its
	// polls.
	if !slices.Contains(prepared, first) || !slices.Contains(prepared, second) || len(prepared) != 2 {
		t.Fatalf("prepared on the poll's session: %q; want the statements of both sets of schemas led, once each", prepared)
	}
}

// The poll over more schemas than a statement holds (pollChunk) sends a
// statement per chunk in one round trip, each planned again alone when one
// of its tables changes, and finds the rows of every chunk: here of the
// first schema and of two past the first chunk.
func TestFleetPollChunks(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := testenv.DatabaseURL()
	var suffixes []string
	for i := range 2*pollChunk + 3 {
		suffixes = append(suffixes, fmt.Sprintf("%02d", i))
	}
	r, led, conn := pollTenants(t, "fchunk", suffixes)
	want := []string{led[0].schema, led[pollChunk+1].schema, led[2*pollChunk+2].schema}
	for _, schema := range want {
		if _, err := NewStager(schema).Stage(ctx, conn, Job{Name: "W"}); err != nil {
			t.Fatal(err)
		}
	}
	pool, err := pgxpool.New(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	s := &fleetSession{f: r.fleet, pool: pool}
	if n, err := s.poll(ctx, led, false); err != nil || n != len(want) {
		t.Fatalf("the poll found %d schemas with rows, want %d (%v); error: %v", n, len(want), want, err)
	}
	if len(s.pollSQL) != 3 {
		t.Fatalf("the poll over %d schemas is %d statements, want 3 of %d at most", len(led), len(s.pollSQL), pollChunk)
	}
	var woken []string
	for _, l := range led {
		select {
		case <-l.wake:
			woken = append(woken, l.schema)
		default:
		}
	}
	if !slices.Equal(woken, want) {
		t.Fatalf("the poll woke %v, want %v", woken, want)
	}
}

// A hot fleet's shared drain takes a few tens of milliseconds, and its hot
// poll runs every few: a poll that ran while a shared drain claimed, or
// before it committed, found the rows it was taking, and drained again
// each such schema came back empty (a third of the shared drains' claims
// over 200 schemas). The hot poll looks above the ids a shared drain in
// flight claimed, does not count or offer a row the last shared drain of
// its schema deleted, and the next shared drain leaves out a schema whose
// row found was so deleted; a row that committed late below those ids is
// found, and a fallback poll looks from the mark. Here the deleted row is
// one still staged, as a poll's older snapshot sees it.
func TestFleetHotPollSkipsRowsSharedDrainsTook(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	fx := newOneTenantFleet(t, "fstale")
	r, own, pool := fx.fleet, fx.tn.r, fx.pool
	led := []*tenant{fx.tn}
	stage := fx.stage
	first := stage()
	d := &sharedDrainer{f: r.fleet, offers: make(map[*tenant]sharedOffer), ping: make(chan struct{}, 1)}
	s := &fleetSession{f: r.fleet, pool: pool, drainer: d}
	polled := func(hot bool) (int, []*tenant) {
		t.Helper()
		n, _ := s.poll(ctx, led, hot)
		select {
		case <-led[0].wake:
		default:
		}
		return n, d.take()
	}

	if n, got := polled(true); n != 1 || len(got) != 1 {
		t.Fatalf("a hot poll found %d schemas and offered %d, want the staged row's schema once", n, len(got))
	}
	// The last shared drain deleted it, after the poll's snapshot. (Its
	// time is an hour ahead, so that a busy machine's pauses never make it
	// stale: sharedStale is checked on its own below.)
	justNow := time.Now().Add(time.Hour)
	own.sharedIDs.Store(&sharedDeleted{ids: []int64{first}, at: justNow})
	if n, got := polled(true); n != 0 || len(got) != 0 {
		t.Fatalf("a hot poll found %d schemas and offered %d for a row the last shared drain deleted, want none", n, len(got))
	}
	// A schema whose commit notified is taken all the same: the
	// notification is of a commit the polls may not have seen.
	d.offer(led, []int64{first})
	d.notify(fx.tn)
	if got := d.take(); len(got) != 1 {
		t.Fatalf("the shared drain took %d schemas of one found by a deleted row and notified, want it", len(got))
	}
	if n, _ := polled(false); n != 1 {
		t.Fatalf("a fallback poll found %d schemas, want 1: it looks from the mark", n)
	}
	// Staged again a second after the claim (its delete lost in a crash):
	// found.
	own.sharedIDs.Store(&sharedDeleted{ids: []int64{first}, at: time.Now().Add(-sharedStale - time.Millisecond)})
	if n, got := polled(true); n != 1 || len(got) != 1 {
		t.Fatalf("a hot poll found %d schemas and offered %d for a row a shared drain claimed %v ago, want it found", n, len(got), sharedStale)
	}
	own.sharedIDs.Store(&sharedDeleted{ids: []int64{first}, at: justNow})
	// Found by a poll, then deleted by the shared drain in flight: the
	// next one leaves the schema out.
	own.sharedIDs.Store(nil)
	s.poll(ctx, led, true)
	own.sharedIDs.Store(&sharedDeleted{ids: []int64{first}, at: justNow})
	if got := d.take(); len(got) != 0 {
		t.Fatalf("the next shared drain takes %d schemas whose row found the last one deleted, want none", len(got))
	}
	// A row above the ids in flight is found, and so is a row that is not
	// one the shared drain deleted.
	own.inFlight.Store(first)
	second := stage()
	if n, got := polled(true); n != 1 || len(got) != 1 {
		t.Fatalf("a hot poll found %d schemas and offered %d, want row %d above the shared drain's ids in flight", n, len(got), second)
	}
	own.inFlight.Store(0)
	own.sharedIDs.Store(&sharedDeleted{ids: []int64{second}, at: justNow})
	if n, got := polled(true); n != 1 || len(got) != 1 {
		t.Fatalf("a hot poll found %d schemas and offered %d, want row %d, which the last shared drain did not take", n, len(got), first)
	}
}

// While the fleet runs hot its fallback poll looks only at the schemas the
// hot poll leaves out (held back by backpressure): the others' own drains
// would claim what the shared drains take.
func TestFleetFallbackPollWhileHot(t *testing.T) {
	a, b := &tenant{schema: "a", r: &Relay{}}, &tenant{schema: "b", r: &Relay{}}
	b.r.heldBack.Store(true)
	if got := fallbackPolled([]*tenant{a, b}, false); len(got) != 2 {
		t.Fatalf("cool: the fallback poll looks at %d schemas, want both", len(got))
	}
	if got := fallbackPolled([]*tenant{a, b}, true); len(got) != 1 || got[0] != b {
		t.Fatalf("hot: the fallback poll looks at %v, want b (held back) only", got)
	}
}

// A schema's shared claims read what its low-water mark needs once a
// second at most (sharedMarkEvery): under load a hot fleet's schema is in
// a shared drain every 100-150ms with a job or two, and the read cost half
// as much as the claim. A claim that did not read it adds no candidate and
// confirms none; one that did moves the mark, here past both rows drained.
func TestFleetSharedClaimReadsTheMarkOnceASecond(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	fx := newOneTenantFleet(t, "fmark")
	r, own, tn, pool := fx.fleet, fx.tn.r, fx.tn, fx.pool
	w := &lowWater{mark: fromStart}
	own.mark.Store(w)
	var ids []int64
	claim := func() *sharedPart {
		t.Helper()
		id := fx.stage()
		ids = append(ids, id)
		c, err := pool.Acquire(ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Release()
		p := &sharedPart{t: tn, r: own, clean: true}
		if err := r.fleet.sharedClaim(ctx, c.Conn(), []*sharedPart{p}); err != nil {
			t.Fatal(err)
		}
		if len(p.jobs) != 1 || p.jobs[0].id != id {
			t.Fatalf("the shared claim took %d jobs, want row %d", len(p.jobs), id)
		}
		if _, err := c.Exec(ctx, "COMMIT"); err != nil {
			t.Fatal(err)
		}
		confirmMarks([]*sharedPart{p})
		return p
	}
	if p := claim(); !p.read {
		t.Fatal("the schema's first shared claim did not read its mark")
	}
	// Read just now, whatever pauses a busy machine takes between claims.
	own.sharedMarkAt = time.Now().Add(time.Hour)
	if p := claim(); p.read {
		t.Fatalf("a shared claim read the mark again right after the last read, want once every %v", sharedMarkEvery)
	}
	if got := w.get(); got >= ids[1] {
		t.Fatalf("the mark is %d, past row %d, whose claim read nothing for it", got, ids[1])
	}
	// A second later, and again while another session's transaction on
	// the shared server, older than the first claim's, holds xmin below it.
	testenv.WaitFor(t, time.Minute, fmt.Sprintf("the mark passes row %d, drained by the first claim", ids[0]), func() (bool, string) {
		own.sharedMarkAt = time.Now().Add(-sharedMarkEvery)
		if p := claim(); !p.read {
			t.Fatalf("a shared claim %v after the last read did not read the mark", sharedMarkEvery)
		}
		got := w.get()
		return got >= ids[0], fmt.Sprintf("the mark is %d", got)
	})
}

// oneTenantFleet is a fleet relay and one schema of it, with the schema's
// own relay (what is per schema: sharedIDs, inFlight, the mark), and a
// pool on the shared server.
type oneTenantFleet struct {
	t      *testing.T
	fleet  *Relay
	tn     *tenant
	schema string
	conn   *pgx.Conn
	pool   *pgxpool.Pool
	source Source
}

func newOneTenantFleet(t *testing.T, prefix string) *oneTenantFleet {
	t.Helper()
	return newOneTenantFleetOf(t, prefix, TargetSidekiq, SourceStagedJobs)
}

// newOneTenantFleetOf is newOneTenantFleet for target and source (with
// SourceSidekiqStagedPush, the gem's table as testdata has it), and the
// group of queues (Config.Queues) when given.
func newOneTenantFleetOf(t *testing.T, prefix string, target Target, source Source, queues ...string) *oneTenantFleet {
	t.Helper()
	ctx := context.Background()
	url := testenv.DatabaseURL()
	base := testenv.Name(prefix)
	conn := testenv.Conn(t, url)
	rdb, ns := testenv.Redis(t)
	r, err := New(Config{DatabaseURL: url, Redis: rdb, RedisNamespace: ns, Schemas: []string{base + "_*"}, Target: target, Source: source, Queues: queues})
	if err != nil {
		t.Fatal(err)
	}
	schema := testenv.SchemaNamedIn(t, url, base+"_a")
	if source == SourceSidekiqStagedPush {
		gem, err := os.ReadFile("../testdata/sidekiq_staged_push_jobs.sql")
		if err != nil {
			t.Fatal(err)
		}
		if _, err := conn.Exec(ctx, "CREATE SCHEMA "+pgx.Identifier{schema}.Sanitize()+"; SET search_path TO "+
			pgx.Identifier{schema}.Sanitize()+";\n"+string(gem)+"RESET search_path;"); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := Migrate(ctx, conn, schema, WithSource(source)); err != nil {
		t.Fatal(err)
	}
	own, err := New(Config{DatabaseURL: url, Redis: rdb, RedisNamespace: ns, Schema: schema, Target: target, Source: source, Queues: queues})
	if err != nil {
		t.Fatal(err)
	}
	pool, err := pgxpool.New(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	return &oneTenantFleet{t: t, fleet: r, tn: &tenant{schema: schema, r: own, wake: make(chan struct{}, 1)},
		schema: schema, conn: conn, pool: pool, source: source}
}

// stage commits a row in the schema and returns its id.
func (fx *oneTenantFleet) stage() int64 {
	fx.t.Helper()
	return fx.stageAt("NULL")
}

// table is the name of the schema's table.
func (fx *oneTenantFleet) table() string {
	if fx.source == SourceSidekiqStagedPush {
		return sidekiqStagedPushTable
	}
	return "staged_jobs"
}

// stageAt commits a row whose run_at (the gem's payload's "at") is the
// SQL expression at, and returns its id.
func (fx *oneTenantFleet) stageAt(at string) int64 {
	fx.t.Helper()
	var id int64
	insert := `INSERT INTO ` + pgx.Identifier{fx.schema, "staged_jobs"}.Sanitize() +
		` (job_name, job_args, run_at) VALUES ('W', '[]', ` + at + `) RETURNING id`
	if fx.source == SourceSidekiqStagedPush {
		insert = `INSERT INTO ` + pgx.Identifier{fx.schema, sidekiqStagedPushTable}.Sanitize() + ` (payload, created_at, updated_at)
			VALUES (json_strip_nulls(json_build_object('class', 'W', 'args', '[]'::json, 'at', extract(epoch FROM (` + at + `)::timestamptz))),
				now() AT TIME ZONE 'UTC', now() AT TIME ZONE 'UTC') RETURNING id`
	}
	if err := fx.conn.QueryRow(context.Background(), insert).Scan(&id); err != nil {
		fx.t.Fatal(err)
	}
	return id
}

// A hot poll of a schema whose target has no scheduler (streams, celery)
// finds only the rows its drain would claim: a future row above the mark
// was found by every hot poll, every few milliseconds, waking the drain to
// claim nothing and keeping the fleet hot. The cool polls (the fallback
// poll, and the one as the fleet cools) still find it, so that its drain
// arms its wake-up for the row's run_at. A target with a scheduler
// (sidekiq) claims future rows: every poll finds them.
func TestFleetHotPollLeavesFutureRowsOut(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	for _, c := range []struct {
		target Target
		source Source
		queues []string
	}{{TargetStreams, SourceStagedJobs, nil}, {TargetCelery, SourceStagedJobs, nil}, {TargetSidekiq, SourceStagedJobs, nil},
		{TargetStreams, SourceSidekiqStagedPush, nil}, {TargetStreams, SourceStagedJobs, []string{"default"}}} {
		target := c.target
		t.Run(fmt.Sprintf("%s/%s/queues=%v", c.target, c.source, c.queues), func(t *testing.T) {
			t.Parallel()
			fx := newOneTenantFleetOf(t, fmt.Sprintf("fdue%s%s%d", string(target)[:2], string(c.source)[:2], len(c.queues)), target, c.source, c.queues...)
			led := []*tenant{fx.tn}
			s := &fleetSession{f: fx.fleet.fleet, pool: fx.pool}
			polled := func(hot bool) (found int, woken bool) {
				t.Helper()
				found, _ = s.poll(ctx, led, hot)
				select {
				case <-led[0].wake:
					woken = true
				default:
				}
				return found, woken
			}
			fx.stageAt("now() + interval '1 hour'")
			wantHot := 0
			if target == TargetSidekiq {
				wantHot = 1
			}
			if n, woken := polled(true); n != wantHot || woken != (wantHot == 1) {
				t.Fatalf("with a row due in an hour, a hot poll found %d schemas (woken %v), want %d", n, woken, wantHot)
			}
			if n, woken := polled(false); n != 1 || !woken {
				t.Fatalf("with a row due in an hour, a cool poll found %d schemas (woken %v), want 1: its drain arms its wake-up", n, woken)
			}
			for _, at := range []string{"NULL", "now() - interval '1 second'"} {
				due := fx.stageAt(at)
				if n, woken := polled(true); n != 1 || !woken {
					t.Fatalf("with a row due (run_at %s) above a future one, a hot poll found %d schemas (woken %v), want 1", at, n, woken)
				}
				if _, err := fx.conn.Exec(ctx, `DELETE FROM `+pgx.Identifier{fx.schema, fx.table()}.Sanitize()+` WHERE id = $1`, due); err != nil {
					t.Fatal(err)
				}
				if n, _ := polled(true); n != wantHot {
					t.Fatalf("with the due row gone, a hot poll found %d schemas, want %d", n, wantHot)
				}
			}
		})
	}
}

// countQueries counts the queries a pool's sessions start.
type countQueries struct{ n atomic.Int64 }

func (c *countQueries) TraceQueryStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceQueryStartData) context.Context {
	c.n.Add(1)
	return ctx
}
func (c *countQueries) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

// The tidies of a shared drain's schemas read the WAL's positions once
// between them (250 reads a second over 200 schemas, each its own round
// trip): each schema gets the same positions, noted as its own read would
// note them (whether replication is synchronous, the standbys' retention).
func TestFleetSharedTidiesReadTheWALOnce(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := testenv.DatabaseURL()
	rdb, ns := testenv.Redis(t)
	var relays []*Relay
	for range 3 {
		r, err := New(Config{DatabaseURL: url, Redis: rdb, RedisNamespace: ns, Schema: "public"})
		if err != nil {
			t.Fatal(err)
		}
		relays = append(relays, r)
	}
	pcfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		t.Fatal(err)
	}
	counter := &countQueries{}
	pcfg.ConnConfig.Tracer = counter
	pool, err := pgxpool.NewWithConfig(ctx, pcfg)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	wal := &sharedWAL{pool: pool}
	var first [2]uint64
	for i, r := range relays {
		insert, flush, err := wal.of(ctx, r)()
		if err != nil {
			t.Fatal(err)
		}
		if i == 0 {
			first = [2]uint64{insert, flush}
		} else if [2]uint64{insert, flush} != first {
			t.Fatalf("schema %d got WAL positions %d/%d, the first %d/%d: want the one read", i, insert, flush, first[0], first[1])
		}
		if !r.syncKnown {
			t.Fatalf("schema %d's relay did not note the read (replication's mode unknown)", i)
		}
	}
	if n := counter.n.Load(); n != 1 {
		t.Fatalf("%d queries for the tidies of %d schemas, want one WAL read", n, len(relays))
	}
}

// pollTenants makes a relay --schemas <name>_* (name made unique) and, for
// each suffix, migrates the schema <name>_<suffix> and makes its tenant:
// the relay, the tenants in the suffixes' order, and the test's connection.
func pollTenants(t testing.TB, name string, suffixes []string) (*Relay, []*tenant, *pgx.Conn) {
	t.Helper()
	url := testenv.DatabaseURL()
	base := testenv.Name(name)
	conn := testenv.Conn(t, url)
	rdb, ns := testenv.Redis(t)
	r, err := New(Config{DatabaseURL: url, Redis: rdb, RedisNamespace: ns, Schemas: []string{base + "_*"}})
	if err != nil {
		t.Fatal(err)
	}
	var led []*tenant
	for _, suffix := range suffixes {
		schema := testenv.SchemaNamedIn(t, url, base+"_"+suffix)
		if _, err := Migrate(context.Background(), conn, schema); err != nil {
			t.Fatal(err)
		}
		led = append(led, &tenant{schema: schema, r: r, wake: make(chan struct{}, 1)})
	}
	return r, led, conn
}

// pollSession is a fleet session of r polling on a pool of the relay's own
// drain configuration with one connection, so that the poll's session is
// the one the test reads; the pool is closed when the test ends.
func pollSession(t testing.TB, r *Relay) (*fleetSession, *pgxpool.Pool) {
	t.Helper()
	pcfg, err := r.drainPoolConfig()
	if err != nil {
		t.Fatal(err)
	}
	pcfg.MaxConns = 1
	pool, err := pgxpool.NewWithConfig(context.Background(), pcfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	return &fleetSession{f: r.fleet, pool: pool}, pool
}

// A poll over a schema whose table is under an ACCESS EXCLUSIVE lock (the
// app's ALTER TABLE on one tenant) leaves that schema to its own drain,
// which it wakes, and still finds the others' rows: it waits for the lock
// pollLockTimeout, finds the table in pg_locks and polls the others again
// at once. The polls after it leave the schema out until pg_locks shows
// the lock gone. Without this the poll failed at its timeout, every time,
// and woke every schema.
func TestFleetPollLeavesALockedTableOut(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	r, led, conn := pollTenants(t, "fplock", []string{"a", "b"})
	locked, other := led[0], led[1]
	s, _ := pollSession(t, r)
	s.lockTimeout = pollLockTimeout
	if _, err := s.poll(ctx, led, false); err != nil { // prepared before the lock, as a running fleet's poll is
		t.Fatal(err)
	}

	tx := testenv.LockTable(t, locked.schema, "staged_jobs")
	if _, err := NewStager(other.schema).Stage(ctx, testenv.Conn(t, testenv.DatabaseURL()), Job{Name: "W"}); err != nil {
		t.Fatal(err)
	}
	for _, hot := range []bool{false, true, false} {
		n, err := s.poll(ctx, led, hot)
		if err != nil || n != 1 {
			t.Fatalf("a poll (hot %v) while %s's table was locked found %d schemas with rows, error %v; want %s's", hot, locked.schema, n, err, other.schema)
		}
		if _, out := s.lockedOut[locked]; !out || len(s.lockedOut) != 1 {
			t.Fatalf("left out after a poll (hot %v): %v, want %s alone", hot, s.lockedOut, locked.schema)
		}
	}
	select {
	case <-locked.wake:
	default:
		t.Fatalf("%s, left out, was not woken to drain on its own", locked.schema)
	}

	if err := tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	s.lockedOut[locked] = time.Now() // due to be looked at again
	if _, err := NewStager(locked.schema).Stage(ctx, conn, Job{Name: "W"}); err != nil {
		t.Fatal(err)
	}
	if n, err := s.poll(ctx, led, false); err != nil || n != 2 {
		t.Fatalf("the poll after the lock's release found %d schemas with rows, error %v; want both", n, err)
	}
	if len(s.lockedOut) != 0 {
		t.Fatalf("left out after the lock's release: %v, want none", s.lockedOut)
	}
}

// A hot poll that fails (here it times out on a table under an ACCESS
// EXCLUSIVE lock, the session with no lock timeout) wakes every schema it
// asked about; the hot polls that fail after it within the poll interval
// wake none, each a hotStep from the next. Each failure woke every schema
// once, and beside a saturated server whose hot polls timed out one after
// the other that sent a claim of each schema at it every time. A failing
// fallback poll still wakes them all, and so does a failing hot poll once
// the poll interval has passed.
func TestFleetFailedHotPollsWakeEverySchemaOnceAPollInterval(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	r, led, _ := pollTenants(t, "fphotfail", []string{"a", "b"})
	r.cfg.PollInterval = time.Hour // no failure here is a poll interval after the last wake
	s, _ := pollSession(t, r)
	if _, err := s.poll(ctx, led, true); err != nil { // prepared before the lock, as a running fleet's poll is
		t.Fatal(err)
	}
	woken := func() (n int) {
		for _, t := range led {
			select {
			case <-t.wake:
				n++
			default:
			}
		}
		return n
	}
	woken()

	tx := testenv.LockTable(t, led[0].schema, "staged_jobs")
	for i, c := range []struct {
		hot   bool
		since time.Duration // set hotWokeAll this long ago first (0: leave it)
		want  int
	}{
		{hot: true, want: 2},                       // the first failure
		{hot: true, want: 0},                       // within the poll interval
		{hot: true, want: 0},                       // and again
		{hot: false, want: 2},                      // the fallback poll
		{hot: true, since: 2 * time.Hour, want: 2}, // a poll interval after the last wake
		{hot: true, want: 0},
	} {
		if c.since > 0 {
			s.hotWokeAll = time.Now().Add(-c.since)
		}
		if _, err := s.poll(ctx, led, c.hot); err == nil {
			t.Fatalf("poll %d (hot %v) ended without error while a table it reads was locked: want its timeout", i, c.hot)
		}
		if n := woken(); n != c.want {
			t.Fatalf("poll %d (hot %v) failed and woke %d schemas, want %d", i, c.hot, n, c.want)
		}
	}
	if err := tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := s.poll(ctx, led, true); err != nil {
		t.Fatalf("the hot poll after the lock's release: %v", err)
	}
}
