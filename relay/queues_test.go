package relay_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/stagedrain/stagedrain/relay"
	"github.com/stagedrain/stagedrain/relay/admin"
	"github.com/stagedrain/stagedrain/relay/internal/testenv"
)

// groupRelay is one relay of a queues test, run until stop or the test's
// end, with logs of its own.
type groupRelay struct {
	r    *relay.Relay
	logs *observer.ObservedLogs
	stop context.CancelFunc
	done chan error // Run's result
	idle chan int64 // see harness.startSignaled
}

// startGroup runs a relay of h's schema draining queues (nil: all queues).
// The fallback poll is a minute, so a job that arrives sooner was woken for
// by its commit's NOTIFY.
func (h *harness) startGroup(queues ...string) *groupRelay {
	h.t.Helper()
	core, logs := observer.New(zapcore.DebugLevel)
	cfg := h.config()
	cfg.Queues = queues
	cfg.PollInterval = time.Minute
	cfg.LeaderInterval = 50 * time.Millisecond
	cfg.Logger = zap.New(core).With(zap.Strings("test_queues", queues))
	r, err := relay.New(cfg)
	if err != nil {
		h.t.Fatalf("relay.New(Queues %v): %v", queues, err)
	}
	relay.SetBacklogTTL(r, 0)
	ctx, cancel := context.WithCancel(context.Background())
	g := &groupRelay{r: r, logs: logs, stop: cancel, done: make(chan error, 1), idle: make(chan int64, 1000)}
	relay.SetOnIdle(r, func(listens int64) {
		select {
		case g.idle <- listens:
		default:
		}
	})
	go func() { g.done <- r.Run(ctx) }()
	h.t.Cleanup(func() {
		cancel()
		select {
		case <-g.done:
		case <-time.After(15 * time.Second):
			h.t.Errorf("Run(Queues %v) did not return within 15s of cancel", queues)
		}
	})
	return g
}

// waitRole waits until g's relay reports role.
func (h *harness) waitRole(g *groupRelay, role relay.Role) {
	h.t.Helper()
	testenv.WaitFor(h.t, 10*time.Second, fmt.Sprintf("role %s", role), func() (bool, string) {
		st := g.r.Status()
		return st.Role == role, fmt.Sprintf("role %s; logs %v", st.Role, messages(g.logs))
	})
}

// waitRefused waits for g's Run to return an ErrQueueConflict, and returns
// its message.
func (h *harness) waitRefused(g *groupRelay) string {
	h.t.Helper()
	select {
	case err := <-g.done:
		g.done <- err // for the cleanup
		if !errors.Is(err, relay.ErrQueueConflict) {
			h.t.Fatalf("Run returned %v, want an ErrQueueConflict", err)
		}
		if strings.Contains(err.Error(), "\n") {
			h.t.Errorf("the error is not one line: %q", err)
		}
		return err.Error()
	case <-time.After(10 * time.Second):
		h.t.Fatalf("Run was not refused within 10s; role %s, logs %v", g.r.Status().Role, messages(g.logs))
		return ""
	}
}

// TestQueueGroups runs two groups, {a,b} (a leader and a standby, their
// lists in different orders) and {c}, on one table, with the poll at a
// minute: each job is delivered once, by its group, woken for by NOTIFY;
// a group stopped leaves its queues staged while the other's flow; and a
// standby that takes over drains its group's queues.
func TestQueueGroups(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	ab1 := h.startGroup("a", "b")
	h.waitRole(ab1, relay.RoleLeader)
	ab2 := h.startGroup("b", "a")
	h.waitRole(ab2, relay.RoleStandby)
	c := h.startGroup("c")
	h.waitRole(c, relay.RoleLeader)
	// From now on only a notification (the poll is a minute) wakes them.
	h.waitIdleAfterListen(ab1.idle)
	h.waitIdleAfterListen(c.idle)

	var want = map[string][]string{}
	for _, q := range []string{"a", "b", "c", "a", "c", "b"} {
		want[q] = append(want[q], h.stage(relay.Job{Name: "W", Queue: q}))
	}
	for q, jids := range want {
		h.waitQueueLen(q, int64(len(jids)), 10*time.Second) // the poll is a minute away
	}
	for q, jids := range want {
		if got := h.queueJIDs(q); fmt.Sprint(got) != fmt.Sprint(jids) {
			t.Errorf("queue:%s holds %v, want %v", q, got, jids)
		}
	}
	// Each group pushed under a fence of its own; the all-queues fence
	// was never taken.
	db := h.conn.Config().Database
	for _, group := range []string{"a,b", "c", ""} {
		fence, _ := relay.HandoffKeys(h.ns, db, h.schema, group)
		n, err := h.rdb.Exists(context.Background(), fence).Result()
		if err != nil {
			t.Fatal(err)
		}
		if want := group != ""; (n == 1) != want {
			t.Errorf("fence of group %q: EXISTS %d, want it to exist: %v", group, n, want)
		}
	}

	// Group {c} stopped: a job in c waits, one in a (committed after it)
	// is delivered, by a drain that would have claimed c's row too.
	c.stop()
	<-c.done
	c.done <- nil
	jc := h.stage(relay.Job{Name: "W", Queue: "c"})
	ja := h.stage(relay.Job{Name: "W", Queue: "a"})
	h.waitQueueLen("a", 3, 10*time.Second)
	if got := h.queueJIDs("a")[2]; got != ja {
		t.Errorf("queue:a's last job is %s, want %s", got, ja)
	}
	// The row leaves staged_jobs when its batch commits, just after the
	// push.
	testenv.WaitFor(t, 10*time.Second, "only c's row staged after group {a,b} drained", func() (bool, string) {
		n := h.staged()
		return n == 1, fmt.Sprintf("%d rows staged", n)
	})
	// The backlog gauge of {a,b}'s leader counts its own queues only.
	if b := backlogGauge(t, ab1.r); b != 0 {
		t.Errorf("the {a,b} leader's backlog_jobs is %v with only c's row staged, want 0", b)
	}
	h.startGroup("c")
	h.waitQueueLen("c", 3, 10*time.Second)
	if got := h.queueJIDs("c")[2]; got != jc {
		t.Errorf("queue:c's last job is %s, want %s", got, jc)
	}

	// The leader of {a,b} stops: the standby takes over and drains b.
	ab1.stop()
	h.waitRole(ab2, relay.RoleLeader)
	h.waitIdleAfterListen(ab2.idle)
	jb := h.stage(relay.Job{Name: "W", Queue: "b"})
	h.waitQueueLen("b", 3, 10*time.Second)
	if got := h.queueJIDs("b")[2]; got != jb {
		t.Errorf("queue:b's last job is %s, want %s", got, jb)
	}
	h.waitStaged(0)
}

// TestQueueConflict: beside a group {a,b}, a relay for {b,c} and a relay
// for all queues are refused with a one-line ErrQueueConflict, and {d}
// runs; beside a relay for all queues, a relay with a list is refused; two
// overlapping relays started at the same moment do not both run.
func TestQueueConflict(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	ab := h.startGroup("a", "b")
	h.waitRole(ab, relay.RoleLeader)

	msg := h.waitRefused(h.startGroup("c", "b"))
	if !strings.Contains(msg, `queue "b"`) || !strings.Contains(msg, "stagedrain leader ") {
		t.Errorf("refusal %q does not name the queue and the relay", msg)
	}
	msg = h.waitRefused(h.startGroup())
	if !strings.Contains(msg, "this relay drains all queues") {
		t.Errorf("refusal %q does not say this relay drains all queues", msg)
	}
	d := h.startGroup("d")
	h.waitRole(d, relay.RoleLeader)
	if ab.r.Status().Role != relay.RoleLeader {
		t.Errorf("the {a,b} leader is %s after the refusals", ab.r.Status().Role)
	}

	// Another schema: a relay for all queues, then a list beside it.
	h2 := newHarness(t)
	all := h2.startGroup()
	h2.waitRole(all, relay.RoleLeader)
	msg = h2.waitRefused(h2.startGroup("a"))
	if !strings.Contains(msg, "drains all queues, and this relay drains a list (queues a)") {
		t.Errorf("refusal %q", msg)
	}

	// At the same moment, in a third schema: at least one is refused.
	h3 := newHarness(t)
	x, y := h3.startGroup("x", "y"), h3.startGroup("y")
	select {
	case err := <-x.done:
		x.done <- err
		if !errors.Is(err, relay.ErrQueueConflict) {
			t.Fatalf("{x,y} returned %v", err)
		}
	case err := <-y.done:
		y.done <- err
		if !errors.Is(err, relay.ErrQueueConflict) {
			t.Fatalf("{y} returned %v", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatalf("neither overlapping relay was refused; roles %s, %s", x.r.Status().Role, y.r.Status().Role)
	}
}

// The gate per queue (sql/006_queue_gate.sql, 010), driven exactly as
// TestLateCommitIsDrainedWithoutNotifyOrPoll drives the schema's: a relay
// of {a} holds a's idle lock while it is idle, never the schema's, and
// none while it drains; a commit to a that looks at the gate while it
// drains keeps no lock, will not notify, and commits only after the relay
// went idle, which drains when it ends. Once it is idle, a commit to a
// notifies, and a commit to b, whose relay is absent, does not.
func TestGatePerQueue(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	ctx := context.Background()
	idleA, idleB := relay.IdleLockName(h.schema)+":a", relay.IdleLockName(h.schema)+":b"

	h.stage(relay.Job{Name: "First", Queue: "a"})
	second := h.stage(relay.Job{Name: "Second", Queue: "a"})
	cfg := h.config()
	cfg.Queues = []string{"a"}
	cfg.PollInterval = time.Minute
	cfg.BatchSize = 1
	r, err := relay.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	held, unblock := h.holdAwake(r)
	h.run(r)
	h.waitHeld(held)
	for _, name := range []string{idleA, relay.IdleLockName(h.schema)} {
		if held := h.advisoryLocks(name, "ExclusiveLock", true); held != 0 {
			t.Fatalf("%s held by %d sessions during the second batch, want none (the relay is awake)", name, held)
		}
	}
	listener := listen(t, testenv.DatabaseURL(), h.schema)

	// A commit to a, checked now: the relay of a is awake.
	appConn := testenv.Conn(t, testenv.DatabaseURL())
	tx, err := appConn.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx) //nolint:errcheck // committed below
	if _, err := tx.Exec(ctx, "SET CONSTRAINTS ALL IMMEDIATE"); err != nil {
		t.Fatal(err)
	}
	late, err := h.stager.Stage(ctx, tx, relay.Job{Name: "Late", Queue: "a"})
	if err != nil {
		t.Fatal(err)
	}
	var locks int
	if err := tx.QueryRow(ctx, `SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid()`).Scan(&locks); err != nil || locks != 0 {
		t.Fatalf("the app's transaction holds %d advisory locks after the gate check (%v), want none", locks, err)
	}

	// The relay goes idle: it takes a's idle lock (and no other), noting
	// the app's transaction in progress; it drains when that commits,
	// with the poll a minute away.
	unblock()
	testenv.WaitFor(t, 15*time.Second, "the relay to go idle", func() (bool, string) {
		n := h.advisoryLocks(idleA, "ExclusiveLock", true)
		return n == 1, fmt.Sprintf("%d hold a's idle lock; queue: %v", n, h.queueJIDs("a"))
	})
	for _, name := range []string{idleB, relay.IdleLockName(h.schema)} {
		if held := h.advisoryLocks(name, "ExclusiveLock", true); held != 0 {
			t.Fatalf("%s held by %d sessions beside an idle relay of {a}, want none", name, held)
		}
	}
	// A commit to b: nobody drains b, so it does not notify.
	jb := h.stage(relay.Job{Name: "ToB", Queue: "b"})
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	h.waitQueueLen("a", 3, 10*time.Second)
	if got := h.queueJIDs("a"); got[1] != second || got[2] != late {
		t.Fatalf("delivered %v, want the late job %s last", got, late)
	}
	// A commit to a now: the relay of a is idle, so it notifies, and it
	// is the first notification (b's commit and the late one sent none:
	// notifiesWhenIdle fails on a notification from another backend). A
	// commit made while the relay had left idle meanwhile is tried again.
	toA := testenv.Conn(t, testenv.DatabaseURL())
	t.Logf("b's commit was backend %d's, the late one %d's, the commits to a beside the idle relay are %d's",
		h.conn.PgConn().PID(), appConn.PgConn().PID(), toA.PgConn().PID())
	commits := notifiesWhenIdle(t, listener, toA.PgConn().PID(), func() (uint32, string) {
		got := h.idleLockHolders(idleA)
		if len(got) == 1 {
			return got[0], ""
		}
		return 0, fmt.Sprintf("a's idle lock held by %v, want the relay's lock connection alone", got)
	}, func() {
		if _, err := toA.Exec(ctx, "INSERT INTO "+pgx.Identifier{h.schema, "staged_jobs"}.Sanitize()+" (job_name, job_args, queue) VALUES ('ToA', '[]', 'a')"); err != nil {
			t.Fatal(err)
		}
	})
	h.waitQueueLen("a", int64(3+commits), 10*time.Second)
	// b's row is not the relay's.
	var staged string
	if err := h.conn.QueryRow(ctx, "SELECT jid FROM "+pgx.Identifier{h.schema, "staged_jobs"}.Sanitize()).Scan(&staged); err != nil || staged != jb {
		t.Fatalf("staged: %q (%v), want b's job %s alone", staged, err, jb)
	}
}

// idleLockHolders returns the backends holding a shard of the advisory
// lock name (a relay's idle lock, of its schema or of a group's queue)
// exclusively, as a relay does while it is idle, sorted.
func (h *harness) idleLockHolders(name string) []uint32 {
	h.t.Helper()
	var pids []int64
	err := h.conn.QueryRow(context.Background(), `SELECT coalesce(array_agg(DISTINCT pid::bigint ORDER BY pid::bigint), '{}') FROM pg_locks
		WHERE locktype = 'advisory' AND objsubid = 2 AND mode = 'ExclusiveLock' AND granted
		  AND database = (SELECT oid FROM pg_database WHERE datname = current_database())
		  AND classid::bigint = (hashtext($1)::bigint + 4294967296) % 4294967296`, name).Scan(&pids)
	if err != nil {
		h.t.Fatalf("read pg_locks: %v", err)
	}
	out := make([]uint32, len(pids))
	for i, p := range pids {
		out[i] = uint32(p)
	}
	return out
}

// backlogGauge scrapes r's stagedrain_backlog_jobs.
func backlogGauge(t *testing.T, r *relay.Relay) float64 {
	t.Helper()
	mfs, err := r.MetricsGatherer().Gather()
	if err != nil {
		t.Fatalf("gather: %v", err)
	}
	for _, mf := range mfs {
		if mf.GetName() == "stagedrain_backlog_jobs" && len(mf.GetMetric()) == 1 {
			return mf.GetMetric()[0].GetGauge().GetValue()
		}
	}
	t.Fatalf("no stagedrain_backlog_jobs gauge")
	return 0
}

// leaderGauge returns r's stagedrain_leader gauge: its labels and value.
func leaderGauge(t *testing.T, r *relay.Relay) (map[string]string, float64) {
	t.Helper()
	mfs, err := r.MetricsGatherer().Gather()
	if err != nil {
		t.Fatalf("gather: %v", err)
	}
	for _, mf := range mfs {
		if mf.GetName() == "stagedrain_leader" && len(mf.GetMetric()) == 1 {
			labels := map[string]string{}
			for _, l := range mf.GetMetric()[0].GetLabel() {
				labels[l.GetName()] = l.GetValue()
			}
			return labels, mf.GetMetric()[0].GetGauge().GetValue()
		}
	}
	t.Fatalf("no stagedrain_leader gauge")
	return nil, 0
}

// A standby checks again when it takes over: a conflicting relay that
// appeared while it stood by (here a session holding the queue lock of a
// group {a,z}, as such a relay would) makes it refuse to lead.
func TestQueueConflictAtTakeover(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	leader := h.startGroup("a")
	h.waitRole(leader, relay.RoleLeader)
	standby := h.startGroup("a")
	h.waitRole(standby, relay.RoleStandby)

	other := testenv.Conn(t, testenv.DatabaseURL())
	if _, err := other.Exec(context.Background(), `SELECT pg_advisory_lock_shared(hashtext('stagedrain-queue:' || $1 || ':a'), hashtext('a,z'))`, h.schema); err != nil {
		t.Fatal(err)
	}
	leader.stop()
	msg := h.waitRefused(standby)
	if !strings.Contains(msg, `queue "a"`) {
		t.Errorf("refusal %q does not name queue a", msg)
	}
	if n := standby.logs.FilterMessage("became leader").Len(); n != 0 {
		t.Errorf("the standby became leader beside a conflicting group")
	}
}

// ReadStatus names every group of relays with its leader: beside {a,b}
// (a leader and a standby, their lists in different orders) and {c}, it
// lists both groups, each with the session of its own leader lock, and no
// single Leader; once {c} stops, the one group left is the Leader; when
// {a,b}'s leader stops, its standby's session is. A queue name with
// multi-byte characters and a length not a multiple of four reads back
// whole.
func TestReadStatusQueueGroups(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	h := newHarness(t)
	ab1 := h.startGroup("a", "b")
	h.waitRole(ab1, relay.RoleLeader)
	ab2 := h.startGroup("b", "a")
	h.waitRole(ab2, relay.RoleStandby)
	const long = "rapports_été"
	c := h.startGroup(long)
	h.waitRole(c, relay.RoleLeader)

	read := func() *admin.SchemaStatus {
		t.Helper()
		st, err := admin.ReadStatus(ctx, h.conn, admin.StatusParams{Schema: h.schema})
		if err != nil {
			t.Fatalf("ReadStatus: %v", err)
		}
		return st
	}
	// backendOf is the backend holding lock name's leader lock.
	backendOf := func(lock string) int {
		t.Helper()
		var pid int
		err := h.conn.QueryRow(ctx, `SELECT l.pid FROM pg_locks l WHERE l.locktype = 'advisory' AND l.objsubid = 1 AND l.granted
			AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
			AND (l.classid::bigint << 32 | l.objid::bigint) = hashtextextended($1, 0)`, lock).Scan(&pid)
		if err != nil {
			t.Fatalf("the holder of %s: %v", lock, err)
		}
		return pid
	}
	abLock, cLock := "stagedrain:"+h.schema+":queues=a,b", "stagedrain:"+h.schema+":queues="+long
	st := read()
	if st.Leader != nil || len(st.Groups) != 2 {
		t.Fatalf("status with two groups: leader %+v, groups %+v; want no single leader and two groups", st.Leader, st.Groups)
	}
	host, _ := os.Hostname()
	for i, want := range []struct {
		queues []string
		lock   string
	}{{[]string{"a", "b"}, abLock}, {[]string{long}, cLock}} {
		g := st.Groups[i]
		if !slices.Equal(g.Queues, want.queues) || g.Leader == nil {
			t.Fatalf("group %d = queues %q, leader %+v; want queues %q with a leader", i, g.Queues, g.Leader, want.queues)
		}
		if l := g.Leader; l.BackendPID != backendOf(want.lock) || l.PID != os.Getpid() || !strings.HasPrefix(host, l.Host) ||
			l.Host == "" || l.ConnectedAt.IsZero() {
			t.Errorf("group %q: leader %+v, want backend %d (the holder of its leader lock), this process (pid %d, host %s)",
				want.queues, l, backendOf(want.lock), os.Getpid(), host)
		}
	}
	if st.Groups[0].Leader.BackendPID == st.Groups[1].Leader.BackendPID {
		t.Errorf("both groups show the same leader session %d", st.Groups[0].Leader.BackendPID)
	}
	// stagedrain_leader is told apart by group, so that "no leader" is
	// per group: sum by (schema, queues).
	for _, m := range []struct {
		g     *groupRelay
		group string
		value float64
	}{{ab1, "a,b", 1}, {ab2, "a,b", 0}, {c, long, 1}} {
		labels, v := leaderGauge(t, m.g.r)
		if labels["schema"] != h.schema || labels["queues"] != m.group || v != m.value {
			t.Errorf("stagedrain_leader of a relay of {%s}: %v %v, want schema %s, queues %s: %v", m.group, labels, v, h.schema, m.group, m.value)
		}
	}

	// A stopped relay's backend ends soon after its connection closes,
	// and its locks with it.
	c.stop()
	testenv.WaitFor(t, 10*time.Second, "one group left", func() (bool, string) {
		st = read()
		return len(st.Groups) == 1, fmt.Sprintf("groups %+v", st.Groups)
	})
	if !slices.Equal(st.Groups[0].Queues, []string{"a", "b"}) || st.Leader == nil || st.Leader.BackendPID != backendOf(abLock) {
		t.Fatalf("status with {a,b} alone: leader %+v, groups %+v; want {a,b}'s leader as the leader", st.Leader, st.Groups)
	}
	first := st.Leader.BackendPID
	ab1.stop()
	h.waitRole(ab2, relay.RoleLeader)
	st = read()
	if st.Leader == nil || st.Leader.BackendPID == first || st.Leader.BackendPID != backendOf(abLock) {
		t.Errorf("after the takeover: leader %+v, want the standby's session %d (not %d)", st.Leader, backendOf(abLock), first)
	}
	ab2.stop()
	testenv.WaitFor(t, 10*time.Second, "no group left", func() (bool, string) {
		st = read()
		return len(st.Groups) == 0 && st.Leader == nil, fmt.Sprintf("leader %+v, groups %+v", st.Leader, st.Groups)
	})
}
