package relay_test

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/stagedrain/stagedrain/relay"
	"github.com/stagedrain/stagedrain/relay/internal/testenv"
)

// A fleet whose schemas' commits notify often runs hot: it holds every
// schema it leads awake, so that no commit notifies, and finds their rows
// by polling them all at once; when the commits stop it cools, and each
// schema goes idle again and is notified. Checked by which commits notify
// (a marker notification: notifications arrive in commit order) and who
// holds the idle locks, not by timing. The fallback poll is an hour away,
// so only the hot poll can deliver a commit that does not notify.
func TestFleetHotHoldsEverySchemaAwake(t *testing.T) {
	t.Parallel()
	fh := newFleetHarness(t, 3)
	quiet, busy := fh.schemas[0], fh.schemas[1:]
	r := fh.startHotLeaving()
	for _, s := range fh.schemas {
		waitIdleHeldBy(t, fh.conn, s, fh.leaderPID(s), "its leader (idle)")
	}

	bc := commitBusy(t, busy)
	defer bc.stop()
	testenv.WaitFor(t, 30*time.Second, "the fleet runs hot", func() (bool, string) {
		return relay.FleetHot(r), "not hot"
	})
	// Hot: every schema's drain gives its idle lock back, the quiet one's
	// too, though nothing was staged in it.
	for _, s := range fh.schemas {
		testenv.WaitFor(t, 10*time.Second, s+"'s idle lock held by nobody while the fleet runs hot", func() (bool, string) {
			if !relay.FleetHot(r) {
				t.Fatal("the fleet cooled while its schemas took commits")
			}
			got := idleHolders(t, fh.conn, s)
			return len(got) == 0, fmt.Sprintf("held by %v", got)
		})
	}
	jid := fh.stageHot(quiet)

	// Cooled: each schema goes idle again, and a commit notifies.
	staged := bc.stop()
	fh.waitJIDs("busy", staged)
	testenv.WaitFor(t, 30*time.Second, "the fleet cools once the commits stop", func() (bool, string) {
		return !relay.FleetHot(r), "still hot"
	})
	for _, s := range fh.schemas {
		waitIdleHeldBy(t, fh.conn, s, fh.leaderPID(s), "its leader (idle again)")
	}
	fh.checkNotifies(quiet, []string{jid})
}

// A hot fleet leaves a schema whose queue backpressure holds back to its
// own retries and notifications, as a relay of one schema: it goes idle,
// and the hot poll, which would find its held-back rows every step, leaves
// it out. The other schemas stay awake, polled.
func TestFleetHotLeavesABackpressuredSchemaIdle(t *testing.T) {
	t.Parallel()
	fh := newFleetHarness(t, 2)
	cfg := fh.fleetConfig()
	cfg.PollInterval = time.Hour
	cfg.MaxQueueLength, cfg.BatchSize = 5, 1
	quiet, busy := fh.schemas[0], fh.schemas[1]
	r, err := relay.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	// Hot as long as busy's commits notify at all, however slowly a busy
	// machine makes them.
	relay.SetFleetHotLeave(r, 1)
	relay.SetFleetHotOnRate(r)
	fh.run(r)
	fh.waitLeadsAll(r)
	// Nobody consumes queue busy: it fills to the limit, and busy's rows
	// stay staged.
	bc := commitBusy(t, []string{busy})
	defer bc.stop()
	testenv.WaitFor(t, 30*time.Second, "the fleet runs hot", func() (bool, string) {
		return relay.FleetHot(r), "not hot"
	})
	testenv.WaitFor(t, 10*time.Second, "queue busy full", func() (bool, string) {
		n := len(fh.queueJIDs("busy"))
		return int64(n) >= cfg.MaxQueueLength, fmt.Sprintf("%d jobs", n)
	})
	waitIdleHeldBy(t, fh.conn, busy, fh.leaderPID(busy), "its leader: paused by backpressure, idle")
	if !relay.FleetHot(r) {
		t.Fatal("the fleet cooled while busy took commits: they did not notify, so busy was not idle")
	}
	testenv.WaitFor(t, 10*time.Second, quiet+"'s idle lock held by nobody while the fleet runs hot", func() (bool, string) {
		got := idleHolders(t, fh.conn, quiet)
		return len(got) == 0, fmt.Sprintf("held by %v", got)
	})
	fh.stageHot(quiet)
}

// stageHot commits a job in schema while its fleet runs hot, checks that
// the commit did not notify, waits until it is delivered (by the hot poll:
// the tests' fallback poll is an hour away) and returns its jid.
func (fh *fleetHarness) stageHot(schema string) string {
	fh.t.Helper()
	listener := listen(fh.t, testenv.DatabaseURL(), schema)
	jid := fh.stageIn(schema, "default")
	checkDidNotNotify(fh.t, listener, schema, "a commit while the fleet runs hot")
	fh.waitJIDs("default", []string{jid})
	return jid
}

// busyCommits commits one job at a time in queue busy of some schemas,
// from four sessions, until stopped: each commit notifies while its
// schema is idle.
type busyCommits struct {
	stopc   chan struct{}
	wg      sync.WaitGroup
	mu      sync.Mutex
	staged  []string
	stopped bool
}

// stop stops the commits and returns the jids they staged.
func (b *busyCommits) stop() []string {
	if !b.stopped {
		b.stopped = true
		close(b.stopc)
		b.wg.Wait()
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.staged
}

func commitBusy(t *testing.T, busy []string) *busyCommits {
	return commitBusyOn(t, testenv.DatabaseURL(), "busy", "", func(w, i int) string { return busy[(w+i)%len(busy)] })
}

// commitBusyOn is commitBusy on the database at url, to queue q, each
// session running setup first (if not ""); writer w's i-th commit stages
// in the schema pick(w, i).
func commitBusyOn(t *testing.T, url, q, setup string, pick func(w, i int) string) *busyCommits {
	b := &busyCommits{stopc: make(chan struct{})}
	stop, wg, mu := b.stopc, &b.wg, &b.mu
	for w := range 4 {
		conn := testenv.ConnTo(t, url)
		if setup != "" {
			if _, err := conn.Exec(context.Background(), setup); err != nil {
				t.Fatal(err)
			}
		}
		wg.Go(func() {
			for i := 0; ; i++ {
				select {
				case <-stop:
					return
				default:
				}
				schema := pick(w, i)
				var jid string
				err := conn.QueryRow(context.Background(), fmt.Sprintf(
					`INSERT INTO %q.staged_jobs (job_name, job_args, queue) VALUES ('W', '[]', $1) RETURNING jid`, schema), q).Scan(&jid)
				if err != nil {
					t.Errorf("stage in %s: %v", schema, err)
					return
				}
				mu.Lock()
				b.staged = append(b.staged, jid)
				mu.Unlock()
			}
		})
	}
	return b
}

// count is how many jobs b has staged so far.
func (b *busyCommits) count() int {
	b.mu.Lock()
	defer b.mu.Unlock()
	return len(b.staged)
}

// A fleet that cools takes every schema's idle lock in one statement
// (coolDown), not through each schema's drain: a transaction that looked
// at the gate while the fleet ran hot (so it will not notify) and commits
// after the fleet cooled is still drained, by the fleet's check of the
// transactions that were in progress when it cooled; the fallback poll is
// an hour away. The commits that saw the fleet hot and ended before it
// cooled are delivered too, and once cool a commit notifies.
func TestFleetCoolingDrainsACommitThatSawItHot(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	fh := newFleetHarness(t, 3)
	quiet, busy := fh.schemas[0], fh.schemas[1:]
	r := fh.startHotLeaving()
	bc := commitBusy(t, busy)
	defer bc.stop()
	testenv.WaitFor(t, 30*time.Second, "the fleet runs hot", func() (bool, string) {
		return relay.FleetHot(r), "not hot"
	})
	testenv.WaitFor(t, 10*time.Second, quiet+"'s idle lock held by nobody while the fleet runs hot", func() (bool, string) {
		got := idleHolders(t, fh.conn, quiet)
		return len(got) == 0, fmt.Sprintf("held by %v", got)
	})

	// The app's transaction looks at quiet's gate now (SET CONSTRAINTS
	// ALL IMMEDIATE runs the trigger at the INSERT): awake, so it will not
	// notify, and it keeps no lock.
	app := testenv.Conn(t, testenv.DatabaseURL())
	tx, err := app.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx) //nolint:errcheck // committed below
	if _, err := tx.Exec(ctx, "SET CONSTRAINTS ALL IMMEDIATE"); err != nil {
		t.Fatal(err)
	}
	late, err := relay.NewStager(quiet).Stage(ctx, tx, relay.Job{Name: "Late", Queue: "default"})
	if err != nil {
		t.Fatal(err)
	}

	staged := bc.stop()
	fh.waitJIDs("busy", staged)
	testenv.WaitFor(t, 30*time.Second, "the fleet cools once the commits stop", func() (bool, string) {
		return !relay.FleetHot(r), "still hot"
	})
	for _, s := range fh.schemas {
		waitIdleHeldBy(t, fh.conn, s, fh.leaderPID(s), "its leader (idle again)")
	}
	if got := fh.queueJIDs("default"); len(got) != 0 {
		t.Fatalf("queue default holds %v before the late commit, want nothing", got)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	fh.waitJIDs("default", []string{late})
	fh.checkNotifies(quiet, []string{late})
}

// startHotLeaving runs a fleet relay over fh's schemas, its fallback poll
// an hour away, hot as long as commits come at all (however slowly a busy
// machine makes them) and cool once they stop, and waits until it leads
// every schema.
func (fh *fleetHarness) startHotLeaving() *relay.Relay {
	fh.t.Helper()
	cfg := fh.fleetConfig()
	cfg.PollInterval = time.Hour
	r, err := relay.New(cfg)
	if err != nil {
		fh.t.Fatal(err)
	}
	relay.SetFleetHotLeave(r, 1)
	relay.SetFleetHotOnRate(r)
	fh.run(r)
	fh.waitLeadsAll(r)
	return r
}

// Between hotEnter and hotAlways commits a second a fleet runs hot only
// while sessions wait for a lock on an object, as the app's commits do
// when they queue for PostgreSQL's notify lock; once nobody waits, it
// tries cool (hotProbe) while the commits go on, and stays cool. The
// waiter here is a COMMENT ON SCHEMA behind another's open transaction: a
// lock on an object, as the notify lock is. Every job is delivered.
func TestFleetRunsHotWhileCommitsWait(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	fh := newFleetHarness(t, 2)
	cfg := fh.fleetConfig()
	cfg.PollInterval = time.Hour
	r, err := relay.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	// From one commit a second, never on the rate alone; a try half a
	// second after it went hot; no cooling for want of commits.
	relay.SetFleetHotOnWaits(r, 1, 500*time.Millisecond)
	relay.SetFleetHotLeave(r, 1)
	fh.run(r)
	fh.waitLeadsAll(r)
	bc := commitBusy(t, fh.schemas)
	defer bc.stop()

	holder := testenv.Conn(t, testenv.DatabaseURL())
	tx, err := holder.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx) //nolint:errcheck // rolled back below
	comment := fmt.Sprintf("COMMENT ON SCHEMA %q IS", fh.schemas[0])
	if _, err := tx.Exec(ctx, comment+" 'held'"); err != nil {
		t.Fatal(err)
	}
	waiter := testenv.Conn(t, testenv.DatabaseURL())
	waiterPID := waiter.PgConn().PID()
	waited := make(chan error, 1)
	go func() {
		_, err := waiter.Exec(ctx, comment+" 'waited'")
		waited <- err
	}()
	testenv.WaitFor(t, 10*time.Second, "the waiter waits for a lock on an object", func() (bool, string) {
		var ev *string
		if err := fh.conn.QueryRow(ctx, `SELECT wait_event_type || '/' || wait_event FROM pg_stat_activity WHERE pid = $1`, waiterPID).Scan(&ev); err != nil {
			t.Fatal(err)
		}
		return ev != nil && *ev == "Lock/object", fmt.Sprintf("wait event %v", ev)
	})
	testenv.WaitFor(t, 30*time.Second, "the fleet runs hot while a session waits", func() (bool, string) {
		return relay.FleetHot(r), "cool"
	})
	if hot, entries := hotMetrics(t, r); hot != 1 || entries["waits"] < 1 || entries["rate"] != 0 {
		t.Errorf("hot: stagedrain_fleet_hot %v, entries %v; want 1, on waits only", hot, entries)
	}

	if err := tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	if err := <-waited; err != nil {
		t.Fatal(err)
	}
	testenv.WaitFor(t, 30*time.Second, "the fleet tries cool once nobody waits, the commits going on", func() (bool, string) {
		return !relay.FleetHot(r), "hot"
	})
	testenv.WaitFor(t, 10*time.Second, "stagedrain_fleet_hot 0", func() (bool, string) {
		hot, _ := hotMetrics(t, r)
		return hot == 0 || relay.FleetHot(r), fmt.Sprintf("%v while cool", hot)
	})
	fh.waitJIDs("busy", bc.stop())
}

// A disk that flushes slowly holds the app's notifying commits under
// hotEnter a second: each holds PostgreSQL's notify lock through its WAL
// flush, and the others queue behind it. A fleet that counted waits only
// from hotEnter stayed cool, and beside a fleet of 200 schemas the app kept
// 13% of its TPS (stagedrain bench --scenarios app-cost on a server with
// commit_delay=8ms; 95% with waits counted from hotWaitFrom). Here the
// app's sessions flush in 20ms (commit_delay, which needs fsync on), on a
// server of the test's own, so that its waits reach no other test's fleet;
// the fleet must run hot on the waits, and every job is delivered.
func TestFleetRunsHotWhenSlowCommitsQueue(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	// commit_delay sleeps in the WAL flush only with fsync on.
	pg := testenv.StartPostgres(t, "fsync=on")
	h := &harness{t: t, conn: testenv.ConnTo(t, pg.URL())}
	h.rdb, h.ns = testenv.Redis(t)
	// Many schemas, each seeing a trickle of the commits, as in the
	// bench: a schema whose commits come often keeps its drain awake, and
	// its commits do not notify.
	fh := &fleetHarness{harness: h, base: "sdslow"}
	for i := range 40 {
		name := fmt.Sprintf("%s_%d", fh.base, i)
		if _, err := relay.Migrate(ctx, h.conn, name); err != nil {
			t.Fatalf("migrate %s: %v", name, err)
		}
		fh.schemas = append(fh.schemas, name)
	}
	cfg := fh.fleetConfig()
	cfg.DatabaseURL = pg.URL()
	cfg.PollInterval = time.Hour
	r, err := relay.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	fh.run(r)
	fh.waitLeadsAll(r)

	start := time.Now()
	// Spread: a schema's commits from the four writers come apart, so
	// that its drain goes idle between them and each notifies.
	bc := commitBusyOn(t, pg.URL(), "slow", "SET commit_delay = 20000; SET commit_siblings = 0", func(w, i int) string {
		return fh.schemas[(w*7+i*13)%len(fh.schemas)]
	})
	defer bc.stop()

	testenv.WaitFor(t, 30*time.Second, "the fleet runs hot while slow commits queue for the notify lock", func() (bool, string) {
		var waits string
		if err := h.conn.QueryRow(ctx, `SELECT coalesce(string_agg(wait_event_type || '/' || wait_event, ', '), 'none') FROM pg_stat_activity WHERE wait_event_type = 'Lock' OR wait_event = 'WALWrite'`).Scan(&waits); err != nil {
			t.Fatal(err)
		}
		return relay.FleetHot(r), fmt.Sprintf("cool; %d staged; waiting: %s", bc.count(), waits)
	})
	cool := float64(bc.count()) / time.Since(start).Seconds()
	if cool >= relay.FleetHotEnter {
		t.Fatalf("the app committed %.0f jobs a second before the fleet ran hot, not under hotEnter (%v): its commits did not flush slowly", cool, relay.FleetHotEnter)
	}
	if _, entries := hotMetrics(t, r); entries["waits"] < 1 || entries["rate"] != 0 {
		t.Errorf("entries %v; want on waits only", entries)
	}
	fh.waitJIDs("slow", bc.stop())
}

// A fleet whose role cannot see other roles' wait events (no
// pg_read_all_stats: here the README's grants on each schema, without
// pg_monitor) runs hot on the rate of its commits alone, from hotEnter,
// as before waits were counted: counting waits it cannot see, it would
// never run hot between hotEnter and hotAlways, and the app would pay for
// every notifying commit. Its log line says no waits were counted.
func TestFleetRunsHotOnTheRateWithoutSeeingWaits(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	fh := newFleetHarness(t, 2)
	role, roleURL := testenv.RoleIn(t, testenv.DatabaseURL(), "sdtest_role_")
	for _, s := range fh.schemas {
		for _, g := range relay.ReadmeGrants(t, s, role) {
			if strings.Contains(g, "pg_monitor") {
				continue
			}
			if _, err := fh.conn.Exec(ctx, g); err != nil {
				t.Fatalf("%s: %v", g, err)
			}
		}
	}
	as := testenv.Conn(t, roleURL)
	var sees bool
	if err := as.QueryRow(ctx, `SELECT pg_has_role('pg_read_all_stats', 'USAGE')`).Scan(&sees); err != nil || sees {
		t.Fatalf("the role sees other roles' waits (%v, %v); the test needs one that does not", sees, err)
	}
	cfg := fh.fleetConfig()
	cfg.DatabaseURL = roleURL
	cfg.PollInterval = time.Hour
	r, err := relay.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	// Between the two rates from one commit a second: only waits, which
	// this role cannot see, would make a fleet that sees them run hot.
	relay.SetFleetHotOnWaits(r, 1, time.Hour)
	relay.SetFleetHotLeave(r, 1)
	fh.run(r)
	fh.waitLeadsAll(r)
	bc := commitBusy(t, fh.schemas)
	defer bc.stop()
	testenv.WaitFor(t, 30*time.Second, "the fleet runs hot on the rate alone", func() (bool, string) {
		return relay.FleetHot(r), "cool"
	})
	// The line follows the switch (holdAwake runs between them).
	fh.waitLog("fleet runs hot: polling every schema led", 1)
	hot := fh.logs.FilterMessage("fleet runs hot: polling every schema led").All()
	if w, ok := hot[0].ContextMap()["waiting"]; !ok || w != int64(-1) {
		t.Errorf("went hot with waiting=%v (%T), want -1: no waits counted", w, w)
	}
	if _, entries := hotMetrics(t, r); entries["rate"] < 1 || entries["waits"] != 0 {
		t.Errorf("entries into hot %v, want on the rate only", entries)
	}
	fh.waitJIDs("busy", bc.stop())
}

// hotMetrics reads stagedrain_fleet_hot and the entries into hot of r,
// by reason.
func hotMetrics(t *testing.T, r *relay.Relay) (hot float64, entries map[string]float64) {
	t.Helper()
	fams, err := r.MetricsGatherer().Gather()
	if err != nil {
		t.Fatal(err)
	}
	entries = map[string]float64{}
	for _, f := range fams {
		switch f.GetName() {
		case "stagedrain_fleet_hot":
			hot = f.GetMetric()[0].GetGauge().GetValue()
		case "stagedrain_fleet_hot_entries_total":
			for _, m := range f.GetMetric() {
				entries[m.GetLabel()[0].GetValue()] = m.GetCounter().GetValue()
			}
		}
	}
	return hot, entries
}

// A tenant's table under an ACCESS EXCLUSIVE lock (the app's ALTER TABLE
// or LOCK TABLE on one tenant) does not hold up a hot fleet's poll of the
// others: the poll leaves that schema out, to its own drain, and goes on
// finding the other schemas' commits, which do not notify. Without that,
// every hot poll waited for the lock and failed, and the others' jobs
// were drained only by the wake-ups of every schema that each failure
// sent, never found by a hot poll. Once the lock is released, a job staged
// in the locked schema is delivered (the fallback poll is an hour away).
func TestFleetHotPollLeavesALockedTableOut(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	fh := newFleetHarness(t, 3)
	locked, busy, quiet := fh.schemas[0], fh.schemas[1], fh.schemas[2]
	r, bc := fh.runHotOn(busy)

	tx := testenv.LockTable(t, locked, "staged_jobs")
	// While the lock is held, the hot polls go on for the other schemas:
	// they find the busy schema's commits, and the quiet one's, which does
	// not notify. Before the change every hot poll waited for the lock
	// until its deadline and failed, and found nothing at all. Which path
	// delivers the quiet schema's job is not asserted: on a busy machine
	// a late-commit check or a moment of trying cool can get there first.
	hotWakes := func() float64 { return hotPollWakes(t, r, quiet, busy) }
	before := hotWakes()
	fh.stageHot(quiet)
	testenv.WaitFor(t, 15*time.Second, "a hot poll finding a commit while "+locked+"'s table is locked", func() (bool, string) {
		got := hotWakes() - before
		return got >= 1, fmt.Sprintf("%v hot-poll wake-ups of %s and %s", got, busy, quiet)
	})
	if err := tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	fh.waitJIDs("after", []string{fh.stageIn(locked, "after")})
	fh.waitJIDs("busy", bc.stop())
}

// runHotOn starts a fleet (startHotLeaving) with jobs committed in busy
// one at a time until the test ends (commitBusy), and waits until it runs
// hot. The caller's bc.stop() returns the jids staged so far.
func (fh *fleetHarness) runHotOn(busy string) (*relay.Relay, *busyCommits) {
	fh.t.Helper()
	r := fh.startHotLeaving()
	bc := commitBusy(fh.t, []string{busy})
	fh.t.Cleanup(func() { bc.stop() })
	testenv.WaitFor(fh.t, 30*time.Second, "the fleet runs hot", func() (bool, string) {
		return relay.FleetHot(r), "not hot"
	})
	return r, bc
}

// hotPollWakes is the wake-ups that hot polls sent the drains of schemas,
// in all.
func hotPollWakes(t *testing.T, r *relay.Relay, schemas ...string) float64 {
	g := gathered(t, r)
	var n float64
	for _, s := range schemas {
		n += g.value("stagedrain_wakeups_total", "schema", s, "cause", "hot_poll")
	}
	return n
}

// gathered is one gathering of r's metrics, as a scrape of its endpoint
// would read them.
func gathered(t *testing.T, r *relay.Relay) scraped {
	t.Helper()
	mfs, err := r.MetricsGatherer().Gather()
	if err != nil {
		t.Fatalf("gather: %v", err)
	}
	s := scraped{}
	for _, mf := range mfs {
		s[mf.GetName()] = mf
	}
	return s
}

// A table dropped while the fleet runs hot fails the hot poll, one
// statement over every schema led, for all of them: the session discovers
// at once, leaves the schema out, and its hot polls find the other
// schemas' commits again. Here the fallback poll and its discovery are an
// hour away, and failed hot polls wake every schema once a poll interval
// at most. Which path delivers the quiet schema's job is not asserted (a
// late-commit check can get there first); that hot polls find commits
// again is.
func TestFleetHotPollDiscoversADroppedTable(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	fh := newFleetHarness(t, 3)
	dropped, busy, quiet := fh.schemas[0], fh.schemas[1], fh.schemas[2]
	r, bc := fh.runHotOn(busy)
	conn := testenv.Conn(t, testenv.DatabaseURL())
	if _, err := conn.Exec(ctx, "DROP TABLE "+pgx.Identifier{dropped, "staged_jobs"}.Sanitize()+" CASCADE"); err != nil {
		t.Fatal(err)
	}
	testenv.WaitFor(t, 15*time.Second, "the fleet to let "+dropped+" go", func() (bool, string) {
		var known []string
		for _, s := range r.Status().Schemas {
			known = append(known, s.Schema)
		}
		return !slices.Contains(known, dropped), fmt.Sprintf("schemas %v", known)
	})
	hotWakes := func() float64 { return hotPollWakes(t, r, quiet, busy) }
	before := hotWakes()
	fh.stageHot(quiet)
	testenv.WaitFor(t, 15*time.Second, "a hot poll finding a commit after "+dropped+"'s table was dropped", func() (bool, string) {
		got := hotWakes() - before
		return got >= 1, fmt.Sprintf("%v hot-poll wake-ups of %s and %s, hot %v", got, busy, quiet, relay.FleetHot(r))
	})
	fh.waitJIDs("busy", bc.stop())
}
