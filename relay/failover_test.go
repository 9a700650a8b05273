package relay_test

import (
	"context"
	"fmt"
	"slices"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/stagedrain/stagedrain/relay"
	"github.com/stagedrain/stagedrain/relay/internal/testenv"
)

// failover is a private primary with one streaming standby (with a
// physical replication slot, as Patroni gives each), the schema migrated,
// and a harness whose h.conn is on the primary.
type failover struct {
	h            *harness
	primary      *testenv.PostgresServer
	standby      *testenv.PostgresServer
	multiHostURL string
}

func newFailover(t *testing.T, settings ...string) *failover {
	t.Helper()
	f := &failover{primary: testenv.StartPostgres(t, settings...)}
	f.h = &harness{t: t, schema: "jobs"}
	f.h.rdb, f.h.ns = testenv.Redis(t)
	f.h.conn = testenv.Conn(t, f.primary.URL())
	if _, err := relay.Migrate(context.Background(), f.h.conn, f.h.schema); err != nil {
		t.Fatal(err)
	}
	f.h.stager = relay.NewStager(f.h.schema)
	f.standby = f.primary.StartStandby(t, "standby1")
	f.multiHostURL = fmt.Sprintf("postgres://postgres@127.0.0.1:%d,127.0.0.1:%d/postgres?sslmode=disable&target_session_attrs=read-write",
		f.primary.Port, f.standby.Port)
	return f
}

// stagedOn returns the jids staged on srv.
func stagedOn(t *testing.T, srv *testenv.PostgresServer) []string {
	t.Helper()
	c := testenv.Conn(t, srv.URL())
	defer c.Close(context.Background())
	rows, err := c.Query(context.Background(), `SELECT jid FROM jobs.staged_jobs ORDER BY id`)
	if err != nil {
		t.Fatalf("read staged jids: %v", err)
	}
	jids, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatalf("read staged jids: %v", err)
	}
	return jids
}

// A failover to a standby that has a batch's INSERT and not the relay's
// DELETE brings the rows back on the new primary: the handoff record must
// still know them, so that they are deleted, not pushed a second time. The
// record keeps a field until the standbys have flushed its delete (here:
// the standby's slot, while it is cut off), not only the local WAL.
func TestFailoverDoesNotPushTwice(t *testing.T) {
	t.Parallel()
	f := newFailover(t)
	h := f.h
	first := h.stage(relay.Job{Name: "BeforeCut"})
	testenv.WaitFor(t, 15*time.Second, "the standby to have the first job", func() (bool, string) {
		got := stagedOn(t, f.standby)
		return slices.Equal(got, []string{first}), fmt.Sprintf("standby has %v", got)
	})
	f.standby.SetReceiving(f.primary, false) // it lags from here on

	cfg := h.config()
	cfg.DatabaseURL = f.multiHostURL
	r, err := relay.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	var idles atomic.Int64
	relay.SetOnIdle(r, func(int64) { idles.Add(1) })
	h.run(r)
	h.waitQueueLen("default", 1, 15*time.Second)

	// The delete of the first job is flushed on the primary's disk: a
	// record that follows only the local WAL lets its field go now.
	var lsn string
	if err := h.conn.QueryRow(context.Background(), `SELECT pg_current_wal_insert_lsn()::text`).Scan(&lsn); err != nil {
		t.Fatal(err)
	}
	testenv.WaitFor(t, 10*time.Second, "the primary's WAL flushed past the delete", func() (bool, string) {
		var ok bool
		err := h.conn.QueryRow(context.Background(), `SELECT pg_current_wal_flush_lsn() >= $1::pg_lsn`, lsn).Scan(&ok)
		return err == nil && ok, fmt.Sprint(err)
	})
	// A second batch, then a drain that ends after it (the fallback poll
	// makes one a second): each commit and each drain's end deletes the
	// record fields the relay holds done with.
	second := h.stage(relay.Job{Name: "AfterCut"})
	h.waitQueueLen("default", 2, 15*time.Second)
	n := idles.Load()
	testenv.WaitFor(t, 10*time.Second, "a drain to end after the second job's", func() (bool, string) {
		return idles.Load() > n, fmt.Sprintf("%d idles", idles.Load())
	})
	_, record := h.handoffKeys()
	rec, err := h.rdb.HGetAll(context.Background(), record).Result()
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("record before the failover: %v", rec)

	// The standby, cut off, has the first job's row (its delete never
	// reached it) and not the second (its commit did not either): what
	// the new primary will have. Read before the promotion: after it the
	// relay may drain the new primary before the test reads it.
	if got := stagedOn(t, f.standby); !slices.Equal(got, []string{first}) {
		t.Fatalf("the standby stages %v, want the first job only (%s)", got, first)
	}
	h.conn.Close(context.Background())
	f.primary.Crash()
	f.standby.Promote()
	promoted := time.Now()
	testenv.WaitFor(t, 15*time.Second, "the relay to drain the promoted standby", func() (bool, string) {
		got := stagedOn(t, f.standby)
		return len(got) == 0, fmt.Sprintf("staged %v; logs %v", got, messages(h.logs))
	})
	t.Logf("the relay drained the promoted standby %s after its promotion", time.Since(promoted).Round(time.Millisecond))
	h.conn = testenv.Conn(t, f.standby.URL())
	if got := h.queueJIDs("default"); !slices.Equal(got, []string{first, second}) {
		t.Fatalf("queue holds %v, want each job once: %s then %s (a repeat of %s is the failover's duplicate)", got, first, second, first)
	}
}

// With WaitForStandby, a job whose commit no standby has flushed is not
// pushed: a failover then could take back its data. Once the standby has
// it, it is.
func TestWaitForStandbyPushesOnlyWhatAStandbyHas(t *testing.T) {
	t.Parallel()
	f := newFailover(t)
	h := f.h
	f.standby.SetReceiving(f.primary, false)

	cfg := h.config()
	cfg.DatabaseURL = f.multiHostURL
	cfg.WaitForStandby = true
	r, err := relay.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	behind := make(chan uint64, 100)
	relay.SetOnStandbyBehind(r, func(lsn uint64) {
		select {
		case behind <- lsn:
		default:
		}
	})
	h.run(r)
	jid := h.stage(relay.Job{Name: "Lagging"})
	f.heldBackUntilReceived(t, h, behind, jid, "the standby")
}

// A relay whose URL names a standby does not drain it: it says so once
// and looks again, and drains within 2s of the standby's promotion.
func TestReadOnlyNodeIsNotDrained(t *testing.T) {
	t.Parallel()
	f := newFailover(t)
	h := f.h
	jid := h.stage(relay.Job{Name: "OnTheStandby"})
	testenv.WaitFor(t, 15*time.Second, "the standby to have the job", func() (bool, string) {
		got := stagedOn(t, f.standby)
		return slices.Equal(got, []string{jid}), fmt.Sprintf("standby has %v", got)
	})
	h.conn.Close(context.Background())
	f.primary.Crash()

	cfg := h.config()
	cfg.DatabaseURL = f.standby.URL()
	h.start(cfg)
	const line = "connected to a read-only PostgreSQL (a standby, or default_transaction_read_only): not draining, looking again"
	h.waitLog(line, 1)
	f.standby.Promote()
	promoted := time.Now()
	testenv.WaitFor(t, 2*time.Second, "the relay to push the job within 2s of the promotion", func() (bool, string) {
		n, err := h.rdb.LLen(context.Background(), h.key("queue:default")).Result()
		return err == nil && n == 1, fmt.Sprintf("%d jobs, %v; logs %v", n, err, messages(h.logs))
	})
	t.Logf("pushed %s after the promotion", time.Since(promoted).Round(time.Millisecond))
	if n := h.logs.FilterMessage(line).Len(); n != 1 {
		t.Errorf("%d lines %q, want 1 (logged once while it looks again)", n, line)
	}
	if got := h.queueJIDs("default"); !slices.Equal(got, []string{jid}) {
		t.Fatalf("queue holds %v, want %s", got, jid)
	}
}

// With synchronous replication, a commit whose wait for the standby is
// cancelled becomes visible on the primary without being on the standby.
// The relay, without WaitForStandby, does not push its job until the
// synchronous standby has it.
func TestSynchronousCancelledCommitWaitsForTheStandby(t *testing.T) {
	t.Parallel()
	f := newFailover(t)
	h := f.h
	ctx := context.Background()
	for _, q := range []string{`ALTER SYSTEM SET synchronous_standby_names = '*'`, `SELECT pg_reload_conf()`} {
		if _, err := h.conn.Exec(ctx, q); err != nil {
			t.Fatal(err)
		}
	}
	testenv.WaitFor(t, 15*time.Second, "a synchronous standby", func() (bool, string) {
		var n int
		err := h.conn.QueryRow(ctx, `SELECT count(*) FROM pg_stat_replication WHERE sync_state = 'sync'`).Scan(&n)
		return err == nil && n == 1, fmt.Sprintf("%d, %v", n, err)
	})

	cfg := h.config()
	cfg.DatabaseURL = f.multiHostURL
	r, err := relay.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	behind := make(chan uint64, 100)
	relay.SetOnStandbyBehind(r, func(lsn uint64) {
		select {
		case behind <- lsn:
		default:
		}
	})
	h.run(r)
	f.standby.SetReceiving(f.primary, false)

	// The app commits; its commit waits for the standby, and is cancelled.
	app := testenv.Conn(t, f.primary.URL())
	pid := app.PgConn().PID()
	staged := make(chan error, 1)
	var jid string
	go func() {
		staged <- pgx.BeginFunc(ctx, app, func(tx pgx.Tx) error {
			var err error
			jid, err = h.stager.Stage(ctx, tx, relay.Job{Name: "Cancelled"})
			return err
		})
	}()
	testenv.WaitFor(t, 15*time.Second, "the app's commit to wait for the standby", func() (bool, string) {
		var ev string
		err := h.conn.QueryRow(ctx, `SELECT coalesce(wait_event, '') FROM pg_stat_activity WHERE pid = $1`, pid).Scan(&ev)
		return err == nil && ev == "SyncRep", fmt.Sprintf("wait_event %q, %v", ev, err)
	})
	if _, err := h.conn.Exec(ctx, `SELECT pg_cancel_backend($1)`, pid); err != nil {
		t.Fatal(err)
	}
	if err := <-staged; err != nil {
		t.Fatalf("the app's commit, its wait cancelled: %v (PostgreSQL commits it locally)", err)
	}
	f.heldBackUntilReceived(t, h, behind, jid, "the synchronous standby")
}

// heldBackUntilReceived checks that the relay finds standby (what names
// it) behind three times while jid's commit is not on it, pushing
// nothing, and pushes jid once the standby receives again.
func (f *failover) heldBackUntilReceived(t *testing.T, h *harness, behind <-chan uint64, jid, standby string) {
	t.Helper()
	for i := range 3 {
		select {
		case <-behind:
		case <-time.After(15 * time.Second):
			t.Fatalf("look %d: the relay did not find %s behind within 15s (it must wait for it); queue %v, logs %v",
				i+1, standby, h.queueJIDs("default"), messages(h.logs))
		}
	}
	if got := h.queueJIDs("default"); len(got) != 0 {
		t.Fatalf("queue holds %v while %s lacks the commit, want nothing", got, standby)
	}
	f.standby.SetReceiving(f.primary, true)
	h.waitQueueLen("default", 1, 15*time.Second)
	if got := h.queueJIDs("default"); !slices.Equal(got, []string{jid}) {
		t.Fatalf("queue holds %v, want %s", got, jid)
	}
}
