package relay_test

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/stagedrain/stagedrain/relay"
	"github.com/stagedrain/stagedrain/relay/internal/testenv"
)

// The tests of gate.release: a lead gives back the wake gate's locks
// however it ends, and a drain that stops on backpressure goes idle.

// awakeHolders returns the backends holding a shard of the schema's
// "awake" lock (exclusively, as a relay does while it drains), sorted.
func awakeHolders(t *testing.T, conn *pgx.Conn, schema string) []uint32 {
	t.Helper()
	pids, err := readAwakeHolders(conn, schema)
	if err != nil {
		t.Fatal(err)
	}
	return pids
}

// readAwakeHolders is awakeHolders for a goroutine other than the test's.
func readAwakeHolders(conn *pgx.Conn, schema string) ([]uint32, error) {
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
	st, err := relay.ReadStatus(context.Background(), fh.conn, relay.StatusParams{Schema: schema})
	if err != nil || st.Leader == nil {
		fh.t.Fatalf("ReadStatus(%s): %+v, %v; want a leader", schema, st, err)
	}
	return uint32(st.Leader.BackendPID)
}

// checkNotifies commits one job in schema and checks that the commit
// notified (the gate was free), and that it is delivered.
func (fh *fleetHarness) checkNotifies(schema string, delivered []string) {
	fh.t.Helper()
	testenv.WaitFor(fh.t, 10*time.Second, "nobody holding "+schema+"'s awake lock (its leader idle)", func() (bool, string) {
		got := awakeHolders(fh.t, fh.conn, schema)
		return len(got) == 0, fmt.Sprintf("held by backends %v", got)
	})
	listener := listen(fh.t, testenv.DatabaseURL(), schema)
	jid := fh.stageIn(schema, "default")
	if pid := nextNotifier(fh.t, listener); pid != fh.conn.PgConn().PID() {
		fh.t.Fatalf("notification from backend %d, want the commit's %d", pid, fh.conn.PgConn().PID())
	}
	fh.waitJIDs("default", append(delivered, jid))
}

// A fleet that lets a schema go to another member while it drains it
// (awake) gives back the schema's awake lock: its lock connection, which
// stays open for the schema it keeps, holds none of it, and once the new
// leader has drained, commits in the schema notify again.
func TestFleetWakeGateGoesWithASchemaLetGo(t *testing.T) {
	t.Parallel()
	fh := newFleetHarness(t, 2)
	cfg := fh.fleetConfig()
	cfg.BatchSize = 1 // awake from the second batch on
	// A leader of both lets the last by name go to a second member.
	kept, let := fh.schemas[0], fh.schemas[1]
	var jids []string
	for range 3 {
		jids = append(jids, fh.stageIn(let, "default"))
	}
	a, err := relay.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	held, unblock := fh.holdAwake(a) // kept has no rows: every push is let's
	fh.run(a)
	fh.waitHeld(held)
	testenv.WaitFor(t, 10*time.Second, "the first relay leads both schemas", func() (bool, string) {
		got := leads(a)
		return len(got) == 2, fmt.Sprintf("leads %q", got)
	})
	aPID := fh.leaderPID(let)
	if got := awakeHolders(t, fh.conn, let); !slices.Equal(got, []uint32{aPID}) {
		t.Fatalf("%s's awake lock held by backends %v during its second batch, want the first relay's lock connection %d", let, got, aPID)
	}

	b := fh.start(cfg)
	fh.waitLog("letting a schema go to another member of the fleet", 1)
	unblock() // the batch in flight finishes; the lead ends, mid-drain
	testenv.WaitFor(t, 15*time.Second, "the second relay leads "+let, func() (bool, string) {
		la, lb := leads(a), leads(b)
		return slices.Equal(la, []string{kept}) && slices.Equal(lb, []string{let}), fmt.Sprintf("a leads %q, b leads %q", la, lb)
	})
	if pid := fh.leaderPID(kept); pid != aPID {
		t.Fatalf("%s led by backend %d, want the first relay's lock connection %d, still open", kept, pid, aPID)
	}
	if got := awakeHolders(t, fh.conn, let); slices.Contains(got, aPID) {
		t.Fatalf("%s's awake lock held by backends %v after the first relay let it go: its lock connection %d still holds it", let, got, aPID)
	}
	fh.waitJIDs("default", jids)
	fh.checkNotifies(let, jids)
}

// With PollOnly each led schema's gate is pinned awake; a fleet that lets
// a schema go unpins it, and the new leader pins it on its own connection
// (else it would count itself awake without the lock, and the old leader's
// connection would keep holding it).
func TestFleetWakeGatePollOnlyGoesWithASchemaLetGo(t *testing.T) {
	t.Parallel()
	fh := newFleetHarness(t, 2)
	cfg := fh.fleetConfig()
	cfg.PollOnly = true
	kept, let := fh.schemas[0], fh.schemas[1]
	a := fh.start(cfg)
	testenv.WaitFor(t, 10*time.Second, "the first relay leads both schemas, pinned awake", func() (bool, string) {
		la := leads(a)
		if len(la) != 2 {
			return false, fmt.Sprintf("leads %q", la)
		}
		pid := fh.leaderPID(kept)
		hk, hl := awakeHolders(t, fh.conn, kept), awakeHolders(t, fh.conn, let)
		return slices.Equal(hk, []uint32{pid}) && slices.Equal(hl, []uint32{pid}),
			fmt.Sprintf("awake held by %v and %v, want %d", hk, hl, pid)
	})
	aPID := fh.leaderPID(kept)
	b := fh.start(cfg)
	testenv.WaitFor(t, 15*time.Second, "the second relay leads "+let, func() (bool, string) {
		la, lb := leads(a), leads(b)
		return slices.Equal(la, []string{kept}) && slices.Equal(lb, []string{let}), fmt.Sprintf("a leads %q, b leads %q", la, lb)
	})
	bPID := fh.leaderPID(let)
	testenv.WaitFor(t, 10*time.Second, let+"'s awake lock held by the second relay alone", func() (bool, string) {
		got := awakeHolders(t, fh.conn, let)
		return slices.Equal(got, []uint32{bPID}), fmt.Sprintf("held by %v; the first relay's lock connection is %d, the second's %d", got, aPID, bPID)
	})
	if got := awakeHolders(t, fh.conn, kept); !slices.Equal(got, []uint32{aPID}) {
		t.Fatalf("%s's awake lock held by %v, want the first relay's %d alone", kept, got, aPID)
	}
	fh.waitJIDs("default", []string{fh.stageIn(let, "default"), fh.stageIn(kept, "default")})
}

// A schema of a fleet that steps down while awake (here its fence was
// taken) gives back its awake lock though the lock connection stays open:
// led again, and idle, it holds none, and commits notify. Without the
// release, the second lead would count the first lead's lock as its own
// awake, never release it, and commits would wait for the poll.
func TestFleetWakeGateGoesWithAStepDown(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	fh := newFleetHarness(t, 2)
	cfg := fh.fleetConfig()
	cfg.BatchSize = 1
	s := fh.schemas[1]
	var jids []string
	for range 3 {
		jids = append(jids, fh.stageIn(s, "default"))
	}
	a, err := relay.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	held, unblock := fh.holdAwake(a)
	fh.run(a)
	fh.waitHeld(held)
	if got := awakeHolders(t, fh.conn, s); len(got) != 1 {
		t.Fatalf("%s's awake lock held by %v during its second batch, want the relay's lock connection", s, got)
	}
	// Another relay takes the fence: the third batch's push is refused.
	fence, _ := relay.HandoffKeys(fh.ns, fh.conn.Config().Database, s)
	if err := fh.rdb.HSet(ctx, fence, "token", "another-leader").Err(); err != nil {
		t.Fatal(err)
	}
	unblock()
	fh.waitLog("stepped down", 1)
	down := fh.logs.FilterMessage("stepped down").All()[0]
	if msg := fmt.Sprint(down.ContextMap()["error"]); !strings.Contains(msg, "fenced off") {
		t.Fatalf("stepped down with %q, want the fence's refusal", msg)
	}
	fh.waitJIDs("default", jids) // led again after the backoff
	if got := leads(a); len(got) != 2 {
		t.Fatalf("leads %q after the step-down, want both again", got)
	}
	fh.checkNotifies(s, jids)
}

// A drain that ends on a backpressure stop (maxPausedBatches batches in a
// row held back whole) leaves the relay idle: the next commit notifies, so
// a queue that is not paused need not wait for the retry pausedRetry
// later. Checked from the idle hook, while the drain loop waits in it, so
// that no later drain can make the relay awake meanwhile.
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
	relay.SetOnIdle(r, func(int64) {
		if !relay.StoppedOnBackpressure(r) || once.Swap(true) {
			return
		}
		checked <- func() error {
			got, err := readAwakeHolders(locks, h.schema)
			if err != nil {
				return err
			}
			if len(got) != 0 {
				return fmt.Errorf("the awake lock is held by backends %v after a drain stopped on backpressure, want nobody", got)
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
			for { // past the notification of the staging before the relay ran
				n, err := listener.WaitForNotification(wctx)
				if err != nil {
					return fmt.Errorf("a commit after a drain stopped on backpressure sent no notification in 5s: %w", err)
				}
				if n.PID == app.PgConn().PID() {
					return nil
				}
			}
		}()
	})
	// Queue full is over its limit from the first push: each batch of its
	// rows is held back whole, and the fourth in a row stops the drain.
	if err := h.rdb.LPush(ctx, h.key("queue:full"), slices.Repeat([]any{"x"}, 10)...).Err(); err != nil {
		t.Fatal(err)
	}
	h.stageMany(jobsTo("full", 60, "")...)
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
	if n := h.rdb.LLen(ctx, h.key("queue:full")).Val(); n != 10 {
		t.Fatalf("queue:full holds %d, want the 10 it had (paused)", n)
	}
}
