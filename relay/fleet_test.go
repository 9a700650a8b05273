package relay_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/redis/go-redis/v9"

	"github.com/stagedrain/stagedrain/relay"
	"github.com/stagedrain/stagedrain/relay/admin"
	"github.com/stagedrain/stagedrain/relay/internal/testenv"
)

// fleetHarness is a harness with several migrated schemas named
// <base>_<i>, for relays with Schemas: [<base>_*].
type fleetHarness struct {
	*harness
	base    string
	schemas []string
}

func newFleetHarness(t *testing.T, n int) *fleetHarness {
	t.Helper()
	h := newHarness(t) // its own schema stays out of the pattern
	fh := &fleetHarness{harness: h, base: testenv.Name("sdfleet")}
	for i := range n {
		fh.addSchema(fmt.Sprintf("%s_%d", fh.base, i))
	}
	return fh
}

func (fh *fleetHarness) addSchema(name string) {
	fh.t.Helper()
	testenv.SchemaNamed(fh.t, name)
	if _, err := relay.Migrate(context.Background(), fh.conn, name); err != nil {
		fh.t.Fatalf("migrate %s: %v", name, err)
	}
	fh.schemas = append(fh.schemas, name)
}

func (fh *fleetHarness) fleetConfig() relay.Config {
	cfg := fh.config()
	cfg.Schema = ""
	cfg.Schemas = []string{fh.base + "_*"}
	cfg.PollInterval = 200 * time.Millisecond
	cfg.LeaderInterval = 100 * time.Millisecond
	return cfg
}

// stageIn commits one job to queue q of schema and returns its jid.
func (fh *fleetHarness) stageIn(schema, q string) string {
	fh.t.Helper()
	var jid string
	err := pgx.BeginFunc(context.Background(), fh.conn, func(tx pgx.Tx) error {
		var err error
		jid, err = relay.NewStager(schema).Stage(context.Background(), tx, relay.Job{Name: "W", Queue: q, Args: []any{schema}})
		return err
	})
	if err != nil {
		fh.t.Fatalf("stage in %s: %v", schema, err)
	}
	return jid
}

// waitJIDs waits until queue q holds exactly the jids want, in any order.
func (fh *fleetHarness) waitJIDs(q string, want []string) {
	fh.t.Helper()
	want = slices.Sorted(slices.Values(want))
	testenv.WaitFor(fh.t, 15*time.Second, fmt.Sprintf("%d jobs in queue:%s", len(want), q), func() (bool, string) {
		got := slices.Sorted(slices.Values(fh.queueJIDs(q)))
		return slices.Equal(got, want), fmt.Sprintf("got %d: %v", len(got), got)
	})
}

// leads returns the schemas r leads, by its Status.
func leads(r *relay.Relay) []string {
	var out []string
	for _, s := range r.Status().Schemas {
		if s.Role == relay.RoleLeader {
			out = append(out, s.Schema)
		}
	}
	return out
}

// dropSchema drops schema as an app's migration would, while the fleet may
// be claiming from it: PostgreSQL can then find the DROP and a claim in a
// deadlock (the claim's statement locks the table and, through
// stagedrain_last_id(), its sequence; the DROP locks them in its own
// order) and end one of them. A claim that loses is retried by the relay;
// a DROP that loses is retried here, as its author would.
func dropSchema(t *testing.T, conn *pgx.Conn, schema string) {
	t.Helper()
	for {
		_, err := conn.Exec(context.Background(), "DROP SCHEMA "+pgx.Identifier{schema}.Sanitize()+" CASCADE")
		var pgErr *pgconn.PgError
		if errors.As(err, &pgErr) && pgErr.Code == "40P01" {
			t.Logf("DROP SCHEMA %s: %v; again", schema, err)
			continue
		}
		if err != nil {
			t.Fatal(err)
		}
		return
	}
}

// TestFleetDrainsEverySchema runs one relay for a pattern: it drains every
// matching schema, picks up a schema migrated after it started, lets go of
// one dropped, and keeps draining the rest.
func TestFleetDrainsEverySchema(t *testing.T) {
	fh := newFleetHarness(t, 2)
	// Names apps do write: quotes, spaces, capitals, and one so long that
	// its channel is the md5 form.
	fh.addSchema(fh.base + `_Ten "ant"`)
	fh.addSchema(fh.base + "_" + strings.Repeat("x", 63-len(fh.base)-1))
	if len(fh.schemas) != 4 || len(relay.ChannelName(fh.schemas[3])) != 43 {
		t.Fatalf("the long schema %q (%d bytes) does not get the md5 channel %q", fh.schemas[3], len(fh.schemas[3]), relay.ChannelName(fh.schemas[3]))
	}
	r := fh.start(fh.fleetConfig())
	var want []string
	for _, s := range fh.schemas {
		want = append(want, fh.stageIn(s, "default"))
	}
	// A schema outside the pattern is not drained.
	outside := fh.stage(relay.Job{Name: "W", Queue: "default"})
	fh.waitJIDs("default", want)
	testenv.WaitFor(t, 10*time.Second, "every schema led", func() (bool, string) {
		got := leads(r)
		return len(got) == 4, fmt.Sprintf("leads %q", got)
	})
	if st := r.Status(); st.Role != relay.RoleLeader || len(st.Schemas) != 4 {
		t.Errorf("Status: role %s, %d schemas; want leader of 4", st.Role, len(st.Schemas))
	}

	// A new schema is found within a poll interval, without a restart.
	late := fmt.Sprintf("%s_late", fh.base)
	fh.addSchema(late)
	want = append(want, fh.stageIn(late, "default"))
	fh.waitJIDs("default", want)
	fh.waitLog("schema found", 5)

	// A dropped schema is let go, with a line; the others drain on.
	dropAt := len(fh.logs.All()) // the log lines before the drop
	dropSchema(t, fh.conn, fh.schemas[0])
	fh.waitLog("schema gone: let go", 1)
	want = append(want, fh.stageIn(fh.schemas[1], "default"), fh.stageIn(late, "default"))
	fh.waitJIDs("default", want)
	if slices.Contains(fh.queueJIDs("default"), outside) {
		t.Errorf("the job of a schema outside the pattern was pushed")
	}
	if n := fh.staged(); n != 1 {
		t.Errorf("the schema outside the pattern holds %d rows, want 1", n)
	}
	testenv.WaitFor(t, 10*time.Second, "4 schemas known", func() (bool, string) {
		st := r.Status()
		return len(st.Schemas) == 4, fmt.Sprintf("%d", len(st.Schemas))
	})
	// Each schema's drain is woken by its own channel's notifications,
	// not only by the poll: the listener routes them. The listener made
	// after the drop LISTENs on the four left (the one made for the late
	// schema may have been replaced before its LISTEN, and logged
	// nothing). It may log before "schema gone: let go": a schema that
	// was led is let go once its lead has returned, after the listener
	// is replaced. Before the drop, four channels were the four first
	// schemas'. A schema notifies once its leader is idle again after
	// that LISTEN (a relay gives its idle lock back while nobody listens).
	testenv.WaitFor(t, 15*time.Second, "a listener on the four schemas left, after the drop", func() (bool, string) {
		for _, e := range fh.logs.All()[dropAt:] {
			switch e.Message {
			case "listening", "listener reconnected":
				if e.ContextMap()["channels"] == int64(4) {
					return true, ""
				}
			}
		}
		return false, fmt.Sprintf("all: %v", messages(fh.logs))
	})
	for _, s := range append(fh.schemas[1:], late) {
		waitIdleHeldBy(t, fh.conn, s, fh.leaderPID(s), "its leader (idle, listening)")
	}
	for _, s := range append(fh.schemas[1:], late) {
		want = append(want, fh.stageIn(s, "default"))
	}
	fh.waitJIDs("default", want)
	notified := map[string]float64{}
	mfs, err := r.MetricsGatherer().Gather()
	if err != nil {
		t.Fatalf("gather: %v", err)
	}
	for _, mf := range mfs {
		if mf.GetName() != "stagedrain_wakeups_total" {
			continue
		}
		for _, m := range mf.GetMetric() {
			var schema, cause string
			for _, l := range m.GetLabel() {
				switch l.GetName() {
				case "schema":
					schema = l.GetValue()
				case "cause":
					cause = l.GetValue()
				}
			}
			if cause == "notify" {
				notified[schema] = m.GetCounter().GetValue()
			}
		}
	}
	for _, s := range append(fh.schemas[1:], late) {
		if notified[s] < 1 {
			t.Errorf("schema %q: %v notify wake-ups, want at least 1 (all: %v)", s, notified[s], notified)
		}
	}

	// Metrics carry the schema label.
	labelled := map[string]bool{}
	for _, mf := range mfs {
		if mf.GetName() != "stagedrain_jobs_pushed_total" {
			continue
		}
		for _, m := range mf.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == "schema" {
					labelled[l.GetValue()] = true
				}
			}
		}
	}
	if !labelled[fh.schemas[1]] || !labelled[late] {
		t.Errorf("stagedrain_jobs_pushed_total schema labels %v, want %s and %s among them", labelled, fh.schemas[1], late)
	}
}

// A schema dropped under a fleet is let go, and its fence and handoff
// record leave Redis with it: the record held a settled batch only (its
// rows delivered and deleted; here the field a drain leaves when it has not
// yet seen the WAL flushed past the batch's commit), so nothing in it is
// needed, and a schema created again under the name starts with no ids of
// the old one's rows. The other schema's keys stay.
func TestFleetDropsTheHandoffOfASchemaGone(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	fh := newFleetHarness(t, 2)
	r := fh.start(fh.fleetConfig())
	gone, kept := fh.schemas[0], fh.schemas[1]
	fh.waitJIDs("default", []string{fh.stageIn(gone, "default"), fh.stageIn(kept, "default")})
	testenv.WaitFor(t, 10*time.Second, "both schemas led", func() (bool, string) {
		got := leads(r)
		return len(got) == 2, fmt.Sprintf("leads %q", got)
	})
	db := fh.conn.Config().Database
	fence, record := relay.HandoffKeys(fh.ns, db, gone)
	epoch, err := fh.rdb.HGet(ctx, fence, "epoch").Result()
	if err != nil {
		t.Fatalf("the fence of %s: %v", gone, err)
	}
	if err := fh.rdb.HSet(ctx, record, epoch+":1", "1").Err(); err != nil {
		t.Fatal(err)
	}

	dropSchema(t, fh.conn, gone)
	fh.waitLog("schema gone: let go", 1)
	// Deleted beside the fleet's loop, not on it (forget).
	testenv.WaitFor(t, 10*time.Second, gone+"'s fence and record deleted", func() (bool, string) {
		n, err := fh.rdb.Exists(ctx, fence, record).Result()
		return err == nil && n == 0, fmt.Sprintf("%d of them left (%v)", n, err)
	})
	keptFence, _ := relay.HandoffKeys(fh.ns, db, kept)
	if n, err := fh.rdb.Exists(ctx, keptFence).Result(); err != nil || n != 1 {
		t.Errorf("the fence of %s, still led: EXISTS %d (%v), want 1", kept, n, err)
	}
}

// A schema dropped under a fleet while its Redis hangs: deleting the
// schema's handoff record waits for Redis (2s), and it waited on the loop
// that keeps the fleet's lock connection alive, past that connection's
// idle_session_timeout (2.5 leader intervals, at least 1s): PostgreSQL ended
// it, and the fleet lost every schema's lead. Now the fleet leads the other
// schema on over the same lock connection, and once Redis answers, that
// schema's job is delivered.
func TestFleetSchemaGoneWhileRedisHangs(t *testing.T) {
	t.Parallel()
	fh := newFleetHarness(t, 2)
	srv := testenv.StartRedis(t)
	rdb := redis.NewClient(testenv.RedisOptions(&redis.Options{Addr: fmt.Sprintf("127.0.0.1:%d", srv.Port)}))
	t.Cleanup(func() { _ = rdb.Close() })
	fh.rdb = rdb
	cfg := fh.fleetConfig()
	cfg.Redis = rdb
	r := fh.start(cfg)
	gone, kept := fh.schemas[0], fh.schemas[1]
	fh.waitJIDs("default", []string{fh.stageIn(gone, "default"), fh.stageIn(kept, "default")})
	fh.waitLeadsAll(r)
	pid := leaderPIDOf(t, fh.conn, kept)

	srv.Signal(syscall.SIGSTOP)
	hung := true
	t.Cleanup(func() {
		if hung {
			srv.Signal(syscall.SIGCONT) // a stopped server would not stop
		}
	})
	dropSchema(t, fh.conn, gone)
	fh.waitLog("schema gone: let go", 1)
	fh.waitLog("could not delete the handoff record of a schema gone", 1)
	if got := leaderPIDOf(t, fh.conn, kept); got != pid {
		t.Fatalf("%s is led by backend %d after the delete waited for Redis, want the same lock connection %d", kept, got, pid)
	}
	if got := leads(r); !slices.Equal(got, []string{kept}) {
		t.Fatalf("leads %q, want %q", got, kept)
	}

	srv.Signal(syscall.SIGCONT)
	hung = false
	fh.waitJIDs("default", append(fh.queueJIDs("default"), fh.stageIn(kept, "default")))
	if got := leaderPIDOf(t, fh.conn, kept); got != pid {
		t.Errorf("%s is led by backend %d, want %d", kept, got, pid)
	}
}

// TestFleetMembersSplitSchemas runs two relays with the same Schemas: they
// split the schemas between them, and when one stops the other takes them
// all; every job is delivered once.
func TestFleetMembersSplitSchemas(t *testing.T) {
	fh := newFleetHarness(t, 6)
	a := fh.start(fh.fleetConfig())
	testenv.WaitFor(t, 10*time.Second, "the first relay leads all 6", func() (bool, string) {
		got := leads(a)
		return len(got) == 6, fmt.Sprintf("leads %q", got)
	})
	bctx, stopB := context.WithCancel(context.Background())
	b, err := relay.New(fh.fleetConfig())
	if err != nil {
		t.Fatal(err)
	}
	bdone := make(chan error, 1)
	go func() { bdone <- b.Run(bctx) }()
	defer func() { stopB(); <-bdone }()
	testenv.WaitFor(t, 15*time.Second, "3 schemas each", func() (bool, string) {
		la, lb := leads(a), leads(b)
		return len(la) == 3 && len(lb) == 3, fmt.Sprintf("a leads %q, b leads %q", la, lb)
	})
	la, lb := leads(a), leads(b)
	for _, s := range la {
		if slices.Contains(lb, s) {
			t.Fatalf("schema %s led by both: a %q, b %q", s, la, lb)
		}
	}
	var want []string
	for _, s := range fh.schemas {
		want = append(want, fh.stageIn(s, "default"))
	}
	fh.waitJIDs("default", want)

	stopB()
	if err := <-bdone; err != nil {
		t.Fatalf("b's Run: %v", err)
	}
	bdone <- nil
	testenv.WaitFor(t, 15*time.Second, "a leads all 6 again", func() (bool, string) {
		got := leads(a)
		return len(got) == 6, fmt.Sprintf("leads %q", got)
	})
	for _, s := range fh.schemas {
		want = append(want, fh.stageIn(s, "default"))
	}
	fh.waitJIDs("default", want)
	if got := strings.Join(messages(fh.logs), "\n"); strings.Contains(got, "stepped down") {
		t.Errorf("a relay stepped down (a release must not look like a failure):\n%s", got)
	}
}

// TestFleetSetsAsideASchemaItCannotDrain: a schema that holds a
// staged_jobs table stagedrain did not migrate, and one whose table the
// relay's role may not touch, are each logged at error and retried; the
// other schemas drain meanwhile.
func TestFleetSetsAsideASchemaItCannotDrain(t *testing.T) {
	fh := newFleetHarness(t, 1)
	ctx := context.Background()
	bare := fh.base + "_bare"
	testenv.SchemaNamed(t, bare)
	if _, err := fh.conn.Exec(ctx, "CREATE SCHEMA "+pgx.Identifier{bare}.Sanitize()+"; CREATE TABLE "+pgx.Identifier{bare, "staged_jobs"}.Sanitize()+" (id bigint)"); err != nil {
		t.Fatal(err)
	}
	r := fh.start(fh.fleetConfig())
	fh.waitLog("cannot drain this schema; retrying later", 1)
	want := []string{fh.stageIn(fh.schemas[0], "default")}
	fh.waitJIDs("default", want)
	var bareErr string
	for _, s := range r.Status().Schemas {
		if s.Schema == bare {
			bareErr = s.LastError
			if s.Role == relay.RoleLeader {
				t.Errorf("the unmigrated schema is led")
			}
		}
	}
	if !strings.Contains(bareErr, "not migrated") {
		t.Errorf("the unmigrated schema's last error is %q, want it to say not migrated", bareErr)
	}
	// Migrated later, it is drained without a restart.
	if _, err := fh.conn.Exec(ctx, "DROP TABLE "+pgx.Identifier{bare, "staged_jobs"}.Sanitize()); err != nil {
		t.Fatal(err)
	}
	if _, err := relay.Migrate(ctx, fh.conn, bare); err != nil {
		t.Fatal(err)
	}
	want = append(want, fh.stageIn(bare, "default"))
	fh.waitJIDs("default", want)
}

// TestFleetPollOnlyWithQueues: with PollOnly a fleet has no listener, so
// its one poll statement is what wakes each schema; with Queues it asks
// only for the group's queues, and a queue outside the group stays staged.
func TestFleetPollOnlyWithQueues(t *testing.T) {
	fh := newFleetHarness(t, 2)
	cfg := fh.fleetConfig()
	cfg.PollOnly, cfg.Queues = true, []string{"a"}
	r := fh.start(cfg)
	testenv.WaitFor(t, 10*time.Second, "both schemas led", func() (bool, string) {
		got := leads(r)
		return len(got) == 2, fmt.Sprintf("leads %q", got)
	})
	want := []string{fh.stageIn(fh.schemas[0], "a"), fh.stageIn(fh.schemas[1], "a")}
	other := fh.stageIn(fh.schemas[1], "b")
	fh.waitJIDs("a", want)
	if got := fh.queueJIDs("b"); len(got) != 0 {
		t.Fatalf("queue b, outside the group, got %v", got)
	}
	var n int
	if err := fh.conn.QueryRow(context.Background(), "SELECT count(*) FROM "+pgx.Identifier{fh.schemas[1], "staged_jobs"}.Sanitize()+" WHERE jid = $1", other).Scan(&n); err != nil || n != 1 {
		t.Fatalf("the queue-b row: %d staged, %v; want 1", n, err)
	}
	if got := fh.logs.FilterMessage("listening").Len(); got != 0 {
		t.Errorf("a PollOnly fleet listened (%d lines)", got)
	}
	// The poll statement itself works: no poll failed with an error of its
	// own. A poll may still reach its deadline on a busy machine (seen with
	// two suites at once); jobs are delivered either way, as a failed poll
	// wakes every schema's own drain.
	for _, e := range fh.logs.FilterMessage("fleet poll failed; waking every schema led").All() {
		if msg := fmt.Sprint(e.ContextMap()["error"]); !strings.Contains(msg, "context deadline exceeded") && !strings.Contains(msg, "57014") {
			t.Errorf("the fleet poll failed: %s (all: %v)", msg, messages(fh.logs))
		}
	}
	// Each schema's status names the group and its leader: the fleet's
	// lock connection, one for both.
	var backends []int
	for _, schema := range fh.schemas {
		st, err := admin.ReadStatus(context.Background(), fh.conn, admin.StatusParams{Schema: schema})
		if err != nil {
			t.Fatal(err)
		}
		if len(st.Groups) != 1 || !slices.Equal(st.Groups[0].Queues, []string{"a"}) || st.Leader == nil || st.Groups[0].Leader != st.Leader {
			t.Fatalf("status of %s: leader %+v, groups %+v; want the group {a} and its leader", schema, st.Leader, st.Groups)
		}
		backends = append(backends, st.Leader.BackendPID)
	}
	if backends[0] != backends[1] {
		t.Errorf("the schemas' leaders are sessions %v, want the fleet's one lock connection", backends)
	}
}

// TestFleetLockConnectionLost: when PostgreSQL ends the lock connection
// (here pg_terminate_backend; a freeze past idle_session_timeout does the
// same), every schema it led is let go at once, and the relay reconnects
// and leads them all again.
func TestFleetLockConnectionLost(t *testing.T) {
	fh := newFleetHarness(t, 3)
	ctx := context.Background()
	r := fh.start(fh.fleetConfig())
	testenv.WaitFor(t, 10*time.Second, "every schema led", func() (bool, string) {
		got := leads(r)
		return len(got) == 3, fmt.Sprintf("leads %q", got)
	})
	st, err := admin.ReadStatus(ctx, fh.conn, admin.StatusParams{Schema: fh.schemas[0]})
	if err != nil || st.Leader == nil {
		t.Fatalf("ReadStatus: %+v, %v; want a leader", st, err)
	}
	// One connection holds every schema's leader lock.
	for _, s := range fh.schemas[1:] {
		other, err := admin.ReadStatus(ctx, fh.conn, admin.StatusParams{Schema: s})
		if err != nil || other.Leader == nil || other.Leader.BackendPID != st.Leader.BackendPID {
			t.Fatalf("schema %s: leader %+v, %v; want the lock connection of %s's (pid %d)", s, other.Leader, err, fh.schemas[0], st.Leader.BackendPID)
		}
	}
	var ok bool
	if err := fh.conn.QueryRow(ctx, `SELECT pg_terminate_backend($1)`, st.Leader.BackendPID).Scan(&ok); err != nil || !ok {
		t.Fatalf("pg_terminate_backend(%d) = %v, %v", st.Leader.BackendPID, ok, err)
	}
	fh.waitLog("database session failed, retrying", 1)
	fh.waitLog("became leader", 6)
	var want []string
	for _, s := range fh.schemas {
		want = append(want, fh.stageIn(s, "default"))
	}
	fh.waitJIDs("default", want)
}

// TestFleetStagedPushSource: a fleet of the sidekiq-staged_push gem's
// tables finds the schemas that hold the gem's table (not staged_jobs),
// and drains each, its poll asking that table.
func TestFleetStagedPushSource(t *testing.T) {
	h := newHarness(t)
	ctx := context.Background()
	base := testenv.Name("sdfleetgem")
	var schemas []string
	for i := range 2 {
		s := testenv.SchemaNamed(t, fmt.Sprintf("%s_%d", base, i))
		if _, err := h.conn.Exec(ctx, `CREATE SCHEMA `+pgx.Identifier{s}.Sanitize()+`;`+gemTableSQL(t, s)); err != nil {
			t.Fatalf("create the gem's table: %v", err)
		}
		if _, err := relay.Migrate(ctx, h.conn, s, relay.WithSource(relay.SourceSidekiqStagedPush)); err != nil {
			t.Fatalf("migrate %s: %v", s, err)
		}
		schemas = append(schemas, s)
	}
	// A schema of the pattern with staged_jobs but not the gem's table is
	// not this fleet's.
	other := testenv.SchemaNamed(t, base+"_staged")
	if _, err := relay.Migrate(ctx, h.conn, other); err != nil {
		t.Fatal(err)
	}
	cfg := h.config()
	cfg.Schema, cfg.Schemas, cfg.Source = "", []string{base + "_*"}, relay.SourceSidekiqStagedPush
	cfg.PollInterval, cfg.LeaderInterval = 200*time.Millisecond, 100*time.Millisecond
	r := h.start(cfg)
	testenv.WaitFor(t, 10*time.Second, "both gem schemas led", func() (bool, string) {
		got := leads(r)
		return slices.Equal(got, schemas), fmt.Sprintf("leads %q", got)
	})
	for i, s := range schemas {
		jid := fmt.Sprintf("%024x", i+1)
		if _, err := h.conn.Exec(ctx, `INSERT INTO `+pgx.Identifier{s, "sidekiq_staged_push_jobs"}.Sanitize()+` (payload, created_at, updated_at)
			VALUES ($1::json, now() AT TIME ZONE 'UTC', now() AT TIME ZONE 'UTC')`,
			`{"class":"GemJob","args":[1],"queue":"gem","jid":"`+jid+`"}`); err != nil {
			t.Fatal(err)
		}
	}
	h.waitQueueLen("gem", 2, 10*time.Second)
	if st := r.Status(); len(st.Schemas) != 2 {
		t.Errorf("Status().Schemas = %v, want the 2 gem schemas", st.Schemas)
	}
}

// waitLeadsAll waits until the fleet relay r leads every schema of fh.
func (fh *fleetHarness) waitLeadsAll(r *relay.Relay) {
	fh.t.Helper()
	testenv.WaitFor(fh.t, 10*time.Second, "the relay leads every schema", func() (bool, string) {
		got := leads(r)
		return len(got) == len(fh.schemas), fmt.Sprintf("leads %q", got)
	})
}
