package relay_test

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/stagedrain/stagedrain/relay"
	"github.com/stagedrain/stagedrain/relay/admin"
	"github.com/stagedrain/stagedrain/relay/internal/testenv"
)

// The tests of gate.release: a lead gives back the wake gate's locks
// however it ends, and a drain that stops on backpressure goes idle.

// idleHolders returns the backends holding a shard of the schema's
// "idle" lock (exclusively, as a relay does while it is idle), sorted.
func idleHolders(t *testing.T, conn *pgx.Conn, schema string) []uint32 {
	t.Helper()
	pids, err := readIdleHolders(conn, schema)
	if err != nil {
		t.Fatal(err)
	}
	return pids
}

// readIdleHolders is idleHolders for a goroutine other than the test's.
func readIdleHolders(conn *pgx.Conn, schema string) ([]uint32, error) {
	rows, err := conn.Query(context.Background(), `SELECT DISTINCT pid::bigint FROM pg_locks
		WHERE locktype = 'advisory' AND objsubid = 2 AND mode = 'ExclusiveLock' AND granted
		  AND database = (SELECT oid FROM pg_database WHERE datname = current_database())
		  AND classid::bigint = (hashtext($1)::bigint + 4294967296) % 4294967296
		ORDER BY 1`, relay.IdleLockName(schema))
	if err != nil {
		return nil, fmt.Errorf("read pg_locks: %w", err)
	}
	pids, err := pgx.CollectRows(rows, pgx.RowTo[int64])
	if err != nil {
		return nil, fmt.Errorf("read pg_locks: %w", err)
	}
	out := make([]uint32, len(pids))
	for i, p := range pids {
		out[i] = uint32(p)
	}
	return out, nil
}

// leaderPID returns the backend of the lock connection that leads schema.
func (fh *fleetHarness) leaderPID(schema string) uint32 {
	fh.t.Helper()
	return leaderPIDOf(fh.t, fh.conn, schema)
}

// leaderPIDOf returns the backend of the lock connection that leads
// schema, read on conn.
func leaderPIDOf(t *testing.T, conn *pgx.Conn, schema string) uint32 {
	t.Helper()
	st, err := admin.ReadStatus(context.Background(), conn, admin.StatusParams{Schema: schema})
	if err != nil || st.Leader == nil {
		t.Fatalf("ReadStatus(%s): %+v, %v; want a leader", schema, st, err)
	}
	return uint32(st.Leader.BackendPID)
}

// waitIdleHeldBy waits until schema's idle lock is held by the backend
// pid alone: its relay went idle.
func waitIdleHeldBy(t *testing.T, conn *pgx.Conn, schema string, pid uint32, who string) {
	t.Helper()
	testenv.WaitFor(t, 10*time.Second, schema+"'s idle lock held by "+who+" alone", func() (bool, string) {
		got := idleHolders(t, conn, schema)
		return slices.Equal(got, []uint32{pid}), fmt.Sprintf("held by backends %v, want %d", got, pid)
	})
}

// checkNotifies commits one job in schema, once its leader is idle (its
// lock connection holds the schema's idle lock, and nobody else does), and
// checks that the commit notified (notifiesWhenIdle: a commit made while
// the leader had left idle meanwhile is tried again), and that every job
// committed is delivered, after delivered.
func (fh *fleetHarness) checkNotifies(schema string, delivered []string) {
	fh.t.Helper()
	listener := listen(fh.t, testenv.DatabaseURL(), schema)
	want := slices.Clone(delivered)
	notifiesWhenIdle(fh.t, listener, fh.conn.PgConn().PID(), func() (uint32, string) {
		leader := fh.leaderPID(schema)
		got := idleHolders(fh.t, fh.conn, schema)
		if slices.Equal(got, []uint32{leader}) {
			return leader, ""
		}
		return 0, fmt.Sprintf("%s's idle lock held by backends %v, want its leader %d (idle) alone", schema, got, leader)
	}, func() {
		want = append(want, fh.stageIn(schema, "default"))
	})
	fh.waitJIDs("default", want)
}

// A fleet that lets a schema go to another member while it is idle (its
// lock connection holds the schema's idle lock) gives that lock back: the
// connection, which stays open for the schema it keeps, holds none of it,
// the new leader takes it when it goes idle, and commits in the schema
// notify the new leader. Without the release the old connection would keep
// it: commits would notify a relay that no longer drains the schema, and
// the new leader could never go idle (its lock would time out).
func TestFleetWakeGateGoesWithASchemaLetGo(t *testing.T) {
	t.Parallel()
	fh := newFleetHarness(t, 2)
	cfg := fh.fleetConfig()
	// A leader of both lets the last by name go to a second member.
	kept, let := fh.schemas[0], fh.schemas[1]
	jids := []string{fh.stageIn(let, "default")}
	a := fh.start(cfg)
	testenv.WaitFor(t, 10*time.Second, "the first relay leads both schemas", func() (bool, string) {
		got := leads(a)
		return len(got) == 2, fmt.Sprintf("leads %q", got)
	})
	fh.waitJIDs("default", jids)
	aPID := fh.leaderPID(let)
	waitIdleHeldBy(t, fh.conn, let, aPID, "the first relay's lock connection (idle)")
	waitIdleHeldBy(t, fh.conn, kept, aPID, "the first relay's lock connection (idle)")

	b := fh.start(cfg)
	fh.waitLog("letting a schema go to another member of the fleet", 1)
	testenv.WaitFor(t, 15*time.Second, "the second relay leads "+let, func() (bool, string) {
		la, lb := leads(a), leads(b)
		return slices.Equal(la, []string{kept}) && slices.Equal(lb, []string{let}), fmt.Sprintf("a leads %q, b leads %q", la, lb)
	})
	if pid := fh.leaderPID(kept); pid != aPID {
		t.Fatalf("%s led by backend %d, want the first relay's lock connection %d, still open", kept, pid, aPID)
	}
	if got := idleHolders(t, fh.conn, let); slices.Contains(got, aPID) {
		t.Fatalf("%s's idle lock held by backends %v after the first relay let it go: its lock connection %d still holds it", let, got, aPID)
	}
	waitIdleHeldBy(t, fh.conn, let, fh.leaderPID(let), "the second relay's lock connection (idle)")
	if got := idleHolders(t, fh.conn, kept); !slices.Equal(got, []uint32{aPID}) {
		t.Fatalf("%s's idle lock held by %v, want the first relay's %d alone", kept, got, aPID)
	}
	fh.checkNotifies(let, jids)
}

// With PollOnly no lead ever goes idle: nobody holds either schema's idle
// lock, while one relay leads both, or after it let one go to a second
// (checked from the idle hook, each time a schema's drain has just
// ended), and commits do not notify: the poll delivers.
func TestFleetWakeGatePollOnlyGoesWithASchemaLetGo(t *testing.T) {
	t.Parallel()
	fh := newFleetHarness(t, 2)
	cfg := fh.fleetConfig()
	cfg.PollOnly = true
	kept, let := fh.schemas[0], fh.schemas[1]
	// The hook runs on each schema's drain goroutine: one look at a time.
	var mu sync.Mutex
	locks := testenv.Conn(t, testenv.DatabaseURL())
	var drains atomic.Int64
	held := make(chan string, 1)
	hook := func(int64) {
		mu.Lock()
		defer mu.Unlock()
		for _, s := range fh.schemas {
			got, err := readIdleHolders(locks, s)
			if err != nil || len(got) != 0 {
				select {
				case held <- fmt.Sprintf("%s's idle lock held by %v (%v) after a poll-only drain, want nobody", s, got, err):
				default:
				}
			}
		}
		drains.Add(1)
	}
	newRelay := func() *relay.Relay {
		r, err := relay.New(cfg)
		if err != nil {
			t.Fatal(err)
		}
		relay.SetOnIdle(r, hook)
		fh.run(r)
		return r
	}
	// checkDrains waits until n drains in all have ended, and checks what
	// the hook saw. (The fleet's poll wakes only the schemas with rows.)
	checkDrains := func(n int64) {
		t.Helper()
		testenv.WaitFor(t, 15*time.Second, fmt.Sprintf("%d drains", n), func() (bool, string) {
			return drains.Load() >= n, fmt.Sprintf("%d", drains.Load())
		})
		select {
		case msg := <-held:
			t.Fatal(msg)
		default:
		}
	}

	a := newRelay()
	testenv.WaitFor(t, 10*time.Second, "the first relay leads both schemas", func() (bool, string) {
		la := leads(a)
		return len(la) == 2, fmt.Sprintf("leads %q", la)
	})
	checkDrains(2) // each lead's drain at start
	b := newRelay()
	testenv.WaitFor(t, 15*time.Second, "the second relay leads "+let, func() (bool, string) {
		la, lb := leads(a), leads(b)
		return slices.Equal(la, []string{kept}) && slices.Equal(lb, []string{let}), fmt.Sprintf("a leads %q, b leads %q", la, lb)
	})
	checkDrains(3) // and the second lead's of the schema let go
	before := drains.Load()
	listenKept, listenLet := listen(t, testenv.DatabaseURL(), kept), listen(t, testenv.DatabaseURL(), let)
	jids := []string{fh.stageIn(let, "default"), fh.stageIn(kept, "default")}
	checkDidNotNotify(t, listenLet, let, "a commit beside a poll-only fleet")
	checkDidNotNotify(t, listenKept, kept, "a commit beside a poll-only fleet")
	fh.waitJIDs("default", jids)
	checkDrains(before + 2) // those that delivered them, one per schema
}

// A schema of a fleet that steps down while idle (here the fence was
// taken, and the push of the first batch after a commit woke it, while it
// still held the idle lock, was refused) gives back its idle lock though
// the lock connection stays open. Led again, it is awake while it drains:
// nobody holds the lock during its second batch, and, idle again, its lock
// connection holds it, and commits notify. Without the release the second
// lead would start awake with the first lead's lock still held, and
// commits would notify while it drains.
func TestFleetWakeGateGoesWithAStepDown(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	fh := newFleetHarness(t, 2)
	cfg := fh.fleetConfig()
	cfg.BatchSize = 1
	s := fh.schemas[1]
	jids := []string{fh.stageIn(s, "default")} // the first lead takes the fence with it
	a, err := relay.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	// The 2nd push is the refused one; the 3rd and 4th are the second
	// lead's first and second batches.
	held, unblock := fh.holdAfterPush(a, 3)
	locks := testenv.Conn(t, testenv.DatabaseURL()) // the hook's
	atRefused := make(chan []uint32, 1)
	var pushes atomic.Int32
	relay.SetBeforePush(a, func(context.Context) {
		if pushes.Add(1) == 2 {
			got, err := readIdleHolders(locks, s)
			if err != nil {
				t.Error(err)
			}
			atRefused <- got
		}
	})
	fh.run(a)
	fh.waitJIDs("default", jids)
	aPID := fh.leaderPID(s)
	// Idle, and its drain ended: the drain takes the idle lock before its
	// last claim, and a commit that this claim finds, or that a drain
	// finds within lingerFor of the last one's end, sends the relay awake
	// before it pushes (seen with two suites at once: "held by []").
	testenv.WaitFor(t, 10*time.Second, s+" idle, its drain ended a while ago", func() (bool, string) {
		got := idleHolders(t, fh.conn, s)
		var last time.Time
		for _, st := range a.Status().Schemas {
			if st.Schema == s {
				last = st.LastDrain
			}
		}
		return slices.Equal(got, []uint32{aPID}) && !last.IsZero() && time.Since(last) > 10*time.Millisecond,
			fmt.Sprintf("idle lock held by backends %v (want %d); last drain ended %v", got, aPID, last)
	})

	// Another relay takes the fence; then a commit of three jobs notifies
	// the idle relay, whose first batch's push is refused.
	fence, _ := relay.HandoffKeys(fh.ns, fh.conn.Config().Database, s)
	if err := fh.rdb.HSet(ctx, fence, "token", "another-leader").Err(); err != nil {
		t.Fatal(err)
	}
	tx, err := fh.conn.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	more, err := relay.NewStager(s).StageMany(ctx, tx, []relay.Job{{Name: "B"}, {Name: "C"}, {Name: "D"}})
	if err != nil {
		t.Fatal(err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	jids = append(jids, more...)
	select {
	case got := <-atRefused:
		if !slices.Equal(got, []uint32{aPID}) {
			t.Fatalf("%s's idle lock held by %v at the push to be refused, want the relay's %d: the case needs a step-down while idle", s, got, aPID)
		}
	case <-time.After(15 * time.Second):
		t.Fatalf("no second push within 15s; logs: %v", messages(fh.logs))
	}
	fh.waitLog("stepped down", 1)
	down := fh.logs.FilterMessage("stepped down").All()[0]
	if msg := fmt.Sprint(down.ContextMap()["error"]); !strings.Contains(msg, "fenced off") {
		t.Fatalf("stepped down with %q, want the fence's refusal", msg)
	}

	// Led again after the backoff, on the same lock connection: during
	// its drain's second batch nobody holds the idle lock.
	fh.waitHeld(held)
	if pid := fh.leaderPID(s); pid != aPID {
		t.Fatalf("%s led again by backend %d, want the same lock connection %d", s, pid, aPID)
	}
	if got := idleHolders(t, fh.conn, s); len(got) != 0 {
		t.Fatalf("%s's idle lock held by %v during the second lead's second batch, want nobody (the stepped-down lead's lock was not given back)", s, got)
	}
	unblock()
	fh.waitJIDs("default", jids)
	if got := leads(a); len(got) != 2 {
		t.Fatalf("leads %q after the step-down, want both again", got)
	}
	fh.checkNotifies(s, jids)
}

// A drain that ends on a backpressure stop for a queue's length
// (maxPausedBatches batches in a row held back whole) leaves the relay
// idle: its lock connection holds the idle lock, and the next commit
// notifies, so a queue that is not paused need not wait for the retry
// pausedRetry later. Checked from the idle hook, while the drain loop
// waits in it, so that no later drain can make the relay awake meanwhile,
// after a drain that began once the listener was LISTENing.
func TestWakeGateIdleAfterBackpressureStop(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	h := newHarness(t)
	cfg := h.config()
	cfg.MaxQueueLength, cfg.BatchSize = 10, 10
	cfg.PollInterval = time.Minute
	r, err := relay.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	url := testenv.DatabaseURL()
	locks := testenv.ConnTo(t, url)
	listener := listen(t, url, h.schema)
	app := testenv.ConnTo(t, url)
	var flowJID string
	checked := make(chan error, 1)
	var once atomic.Bool
	relay.SetOnIdle(r, func(listens int64) {
		// A drain that began before the listener LISTENed stays awake
		// (nobody would hear a notification): check one that began after.
		if listens < 1 || !relay.StoppedOnBackpressure(r) || once.Swap(true) {
			return
		}
		checked <- func() error {
			got, err := readIdleHolders(locks, h.schema)
			if err != nil {
				return err
			}
			st, err := admin.ReadStatus(ctx, locks, admin.StatusParams{Schema: h.schema})
			if err != nil || st.Leader == nil {
				return fmt.Errorf("ReadStatus: %+v, %v; want a leader", st, err)
			}
			if !slices.Equal(got, []uint32{uint32(st.Leader.BackendPID)}) {
				return fmt.Errorf("the idle lock is held by backends %v after a drain stopped on backpressure, want the relay's lock connection %d alone", got, st.Leader.BackendPID)
			}
			err = pgx.BeginFunc(ctx, app, func(tx pgx.Tx) error {
				var err error
				flowJID, err = h.stager.Stage(ctx, tx, relay.Job{Name: "Flow", Queue: "flow"})
				return err
			})
			if err != nil {
				return err
			}
			wctx, cancel := context.WithTimeout(ctx, 5*time.Second)
			defer cancel()
			// The app's commit notifies; the relay's own sessions' (its
			// listener's heartbeat, a batch of its drain) do not count.
			for {
				n, err := listener.WaitForNotification(wctx)
				if err != nil {
					return fmt.Errorf("a commit after a drain stopped on backpressure sent no notification in 5s: %w", err)
				}
				if n.PID == app.PgConn().PID() {
					break
				}
			}
			return nil
		}()
	})
	// Queues full0..full4 are over their limit from the first push, and
	// each holds one batch of rows, in id order: each batch is held back
	// whole (a queue found full is left out of the claims after it, so it
	// takes one full queue per batch), and the fourth in a row stops the
	// drain.
	full := []string{"full0", "full1", "full2", "full3", "full4"}
	for _, q := range full {
		if err := h.rdb.LPush(ctx, h.key("queue:"+q), slices.Repeat([]any{"x"}, 10)...).Err(); err != nil {
			t.Fatal(err)
		}
		h.stageMany(jobsTo(q, 10, "")...)
	}
	h.run(r)
	select {
	case err := <-checked:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(20 * time.Second):
		t.Fatalf("no drain stopped on backpressure within 20s; logs: %v", messages(h.logs))
	}
	h.waitQueueLen("flow", 1, 10*time.Second)
	if got := h.queueJIDs("flow"); got[0] != flowJID {
		t.Fatalf("queue flow holds %v, want %s", got, flowJID)
	}
	for _, q := range full {
		if n := h.rdb.LLen(ctx, h.key("queue:"+q)).Val(); n != 10 {
			t.Fatalf("queue:%s holds %d, want the 10 it had (paused)", q, n)
		}
	}
}
