package admin_test

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
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/stagedrain/stagedrain/relay"
	"github.com/stagedrain/stagedrain/relay/admin"
	"github.com/stagedrain/stagedrain/relay/internal/testenv"
)

// harness is a migrated schema of the shared test database, and a
// connection to it.
type harness struct {
	t      *testing.T
	conn   *pgx.Conn
	schema string
}

func newHarness(t *testing.T) *harness {
	t.Helper()
	h := &harness{t: t, schema: testenv.Schema(t), conn: testenv.Conn(t, testenv.DatabaseURL())}
	if _, err := relay.Migrate(context.Background(), h.conn, h.schema); err != nil {
		t.Fatalf("migrate: %v", err)
	}
	return h
}

// start runs a relay on the schema, with a Redis namespace of its own,
// until the test ends; then it checks that Run returned nil.
func (h *harness) start() {
	h.t.Helper()
	rdb, ns := testenv.Redis(h.t)
	r, err := relay.New(relay.Config{
		DatabaseURL:    testenv.DatabaseURL(),
		Redis:          rdb,
		Schema:         h.schema,
		RedisNamespace: ns,
		MaxBackoff:     500 * time.Millisecond,
	})
	if err != nil {
		h.t.Fatalf("relay.New: %v", err)
	}
	testenv.RunUntilCleanup(h.t, r.Run)
}

// staged counts the rows of the schema's staged_jobs.
func (h *harness) staged() int {
	h.t.Helper()
	var n int
	err := h.conn.QueryRow(context.Background(), "SELECT count(*) FROM "+pgx.Identifier{h.schema, "staged_jobs"}.Sanitize()).Scan(&n)
	if err != nil {
		h.t.Fatalf("count staged_jobs: %v", err)
	}
	return n
}

// testPool is a pool of the shared test database, closed when the test ends.
func testPool(t *testing.T) *pgxpool.Pool {
	t.Helper()
	pool, err := pgxpool.New(context.Background(), testenv.DatabaseURL())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	return pool
}

// ReadStatus counts the backlog by queue with the oldest job's age and the
// dead rows, on a *pgx.Conn and on a *pgxpool.Pool alike; the leader it
// finds is the relay that runs, by the lock name the relay takes.
func TestReadStatus(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	h := newHarness(t)
	staged := pgx.Identifier{h.schema, "staged_jobs"}.Sanitize()
	if _, err := h.conn.Exec(ctx, `INSERT INTO `+staged+` (job_name, job_args, queue, created_at) VALUES
		('A', '[]', 'default', now() - interval '90 seconds'), ('B', '[]', 'default', now()),
		('C', '[]', 'critical', now() - interval '5 seconds')`); err != nil {
		t.Fatal(err)
	}
	dead := pgx.Identifier{h.schema, "staged_jobs_dead"}.Sanitize()
	if _, err := h.conn.Exec(ctx, `INSERT INTO `+dead+` (id, reason, attempts) VALUES (100, 'test', 1)`); err != nil {
		t.Fatal(err)
	}
	for name, db := range map[string]admin.DB{"conn": h.conn, "pool": testPool(t)} {
		st, err := admin.ReadStatus(ctx, db, admin.StatusParams{Schema: h.schema})
		if err != nil {
			t.Fatalf("%s: ReadStatus: %v", name, err)
		}
		if st.Schema != h.schema || st.Staged != 3 || st.OldestAge == nil || *st.OldestAge < 90 || *st.OldestAge > 120 ||
			st.Dead == nil || *st.Dead != 1 || st.Poison != nil || st.Leader != nil {
			t.Errorf("%s: ReadStatus = %+v, want 3 staged, the oldest 90-120s, 1 dead, no poison count, no leader", name, st)
		}
		if len(st.Queues) != 2 || st.Queues[0].Queue != "critical" || st.Queues[0].Staged != 1 ||
			st.Queues[1].Queue != "default" || st.Queues[1].Staged != 2 || st.Queues[1].OldestAge < 90 {
			t.Errorf("%s: queues %+v, want critical 1, default 2 (oldest >= 90s)", name, st.Queues)
		}
	}

	h.start()
	var st *admin.SchemaStatus
	testenv.WaitFor(t, 10*time.Second, "a leader and nothing staged", func() (bool, string) {
		var err error
		st, err = admin.ReadStatus(ctx, h.conn, admin.StatusParams{Schema: h.schema, Source: relay.SourceStagedJobs})
		if err != nil {
			return false, err.Error()
		}
		return st.Leader != nil && st.Staged == 0, fmt.Sprintf("%+v", st)
	})
	host, _ := os.Hostname()
	if l := st.Leader; l.PID != os.Getpid() || !strings.HasPrefix(host, l.Host) || l.Host == "" || l.BackendPID == 0 ||
		l.ConnectedAt.IsZero() || l.ConnectedAt.Location() != time.UTC || !strings.HasPrefix(l.ApplicationName, "stagedrain leader ") {
		t.Errorf("leader = %+v, want this process (host %s, pid %d), its backend, a UTC connection time", l, host, os.Getpid())
	}
}

// An admin operation on a schema without its table is a NotMigratedError
// that matches ErrNotMigrated and names the table; a bad schema or source
// is refused before any statement.
func TestAdminNotMigrated(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	conn := testenv.Conn(t, testenv.DatabaseURL())
	schema := testenv.Schema(t)
	dead := pgx.Identifier{schema, "staged_jobs_dead"}.Sanitize()
	for name, tc := range map[string]struct {
		err   error
		table string
	}{
		"ReadStatus":             {second(admin.ReadStatus(ctx, conn, admin.StatusParams{Schema: schema})), pgx.Identifier{schema, "staged_jobs"}.Sanitize()},
		"ReadStatus staged push": {second(admin.ReadStatus(ctx, conn, admin.StatusParams{Schema: schema, Source: relay.SourceSidekiqStagedPush})), pgx.Identifier{schema, "sidekiq_staged_push_jobs"}.Sanitize()},
		"ListDead":               {second(admin.ListDead(ctx, conn, admin.ListDeadParams{Schema: schema})), dead},
		"RetryDead":              {second(admin.RetryDead(ctx, conn, admin.RetryDeadParams{Schema: schema, All: true})), dead},
		"PurgeDead":              {second(admin.PurgeDead(ctx, conn, admin.PurgeDeadParams{Schema: schema, IDs: []int64{1}})), dead},
	} {
		var nm *admin.NotMigratedError
		if !errors.Is(tc.err, relay.ErrNotMigrated) || !errors.As(tc.err, &nm) || nm.Table != tc.table ||
			!strings.Contains(tc.err.Error(), tc.table+" does not exist: ") || !strings.Contains(tc.err.Error(), "stagedrain migrate") {
			t.Errorf("%s: %v, want a NotMigratedError for %s naming stagedrain migrate", name, tc.err, tc.table)
		}
	}
	if _, err := admin.ReadStatus(ctx, conn, admin.StatusParams{Schema: strings.Repeat("s", 64)}); err == nil || errors.Is(err, relay.ErrNotMigrated) {
		t.Errorf("ReadStatus of a 64-byte schema: %v, want CheckSchema's error", err)
	}
	if _, err := admin.ReadStatus(ctx, conn, admin.StatusParams{Schema: schema, Source: "outbox"}); err == nil || errors.Is(err, relay.ErrNotMigrated) {
		t.Errorf("ReadStatus of source outbox: %v, want CheckSource's error", err)
	}
}

func second[T any](_ T, err error) error { return err }

// insertDead fills schema's staged_jobs_dead with rows 1-4: 1 died 8 days
// ago, 2 a day ago, 3 and 4 now.
func insertDead(t *testing.T, conn *pgx.Conn, schema string) {
	t.Helper()
	dead := pgx.Identifier{schema, "staged_jobs_dead"}.Sanitize()
	if _, err := conn.Exec(context.Background(), "INSERT INTO "+dead+` (id, job_name, job_args, queue, jid, created_at, options, reason, failed_at, attempts) VALUES
		(1, 'Old', '[1]', 'default', 'aaaaaaaaaaaaaaaaaaaaaaaa', now(), '{"retry":3}', 'WRONGTYPE', now() - interval '8 days', 1),
		(2, 'Recent', '[2]', 'critical', 'bbbbbbbbbbbbbbbbbbbbbbbb', now(), '{}', 'WRONGTYPE', now() - interval '1 day', 2),
		(3, 'New', '[3]', 'default', 'cccccccccccccccccccccccc', now(), '{}', 'too big', now(), 1),
		(4, NULL, NULL, NULL, NULL, NULL, NULL, 'NULL column', now(), 1)`); err != nil {
		t.Fatal(err)
	}
}

// deadIDs is the ids ListDead returns.
func deadIDs(t *testing.T, db admin.DB, schema string) []int64 {
	t.Helper()
	res, err := admin.ListDead(context.Background(), db, admin.ListDeadParams{Schema: schema})
	if err != nil {
		t.Fatalf("ListDead: %v", err)
	}
	var ids []int64
	for _, j := range res.Jobs {
		ids = append(ids, j.ID)
	}
	return ids
}

// ListDead returns every dead row, oldest id first, its columns as stored
// (NULLs as nil, JSON as its text); an empty table is an empty list.
func TestListDead(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	h := newHarness(t)
	res, err := admin.ListDead(ctx, h.conn, admin.ListDeadParams{Schema: h.schema})
	if err != nil || res.Jobs == nil || len(res.Jobs) != 0 {
		t.Fatalf("ListDead of an empty table = %+v, %v; want an empty, non-nil list", res, err)
	}
	insertDead(t, h.conn, h.schema)
	res, err = admin.ListDead(ctx, testPool(t), admin.ListDeadParams{Schema: h.schema})
	if err != nil {
		t.Fatal(err)
	}
	if len(res.Jobs) != 4 {
		t.Fatalf("ListDead = %d rows, want 4", len(res.Jobs))
	}
	j := res.Jobs[0]
	if j.ID != 1 || *j.JobName != "Old" || string(j.JobArgs) != "[1]" || *j.Queue != "default" || *j.JID != "aaaaaaaaaaaaaaaaaaaaaaaa" ||
		string(j.Options) != `{"retry": 3}` || j.Reason != "WRONGTYPE" || j.Attempts != 1 || !j.CreatedAt.Valid || j.RunAt.Valid ||
		time.Since(j.FailedAt) < 8*24*time.Hour-time.Minute {
		t.Errorf("first dead row = %+v, want row 1 as inserted", j)
	}
	if j := res.Jobs[3]; j.ID != 4 || j.JobName != nil || string(j.JobArgs) != "null" || j.Queue != nil || j.JID != nil ||
		string(j.Options) != "null" || j.Reason != "NULL column" {
		t.Errorf("last dead row = %+v, want row 4 with its NULLs", j)
	}
}

// RetryDead moves the rows chosen back into staged_jobs with their id and
// jid, in one transaction: an id that is not dead fails it, naming that id,
// and nothing moves; params that choose nothing, or two ways, are refused.
func TestRetryDead(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	h := newHarness(t)
	insertDead(t, h.conn, h.schema)
	p := admin.RetryDeadParams{Schema: h.schema}

	for _, bad := range []admin.RetryDeadParams{p, {Schema: h.schema, All: true, IDs: []int64{1}}} {
		if _, err := admin.RetryDead(ctx, h.conn, bad); !errors.Is(err, admin.ErrNoDeadChosen) {
			t.Errorf("RetryDead(%+v) = %v, want ErrNoDeadChosen", bad, err)
		}
	}
	_, err := admin.RetryDead(ctx, h.conn, admin.RetryDeadParams{Schema: h.schema, IDs: []int64{2, 77, 2, 78}})
	var nf *admin.DeadNotFoundError
	if !errors.As(err, &nf) || !slices.Equal(nf.IDs, []int64{77, 78}) || err.Error() != "no dead row with id 77, 78: nothing changed" {
		t.Fatalf("RetryDead of 2, 77, 78 = %v, want a DeadNotFoundError for 77, 78", err)
	}
	if got := deadIDs(t, h.conn, h.schema); !slices.Equal(got, []int64{1, 2, 3, 4}) || h.staged() != 0 {
		t.Fatalf("after a failed retry: dead %v, %d staged; want 1-4 dead, none staged", got, h.staged())
	}

	res, err := admin.RetryDead(ctx, testPool(t), admin.RetryDeadParams{Schema: h.schema, IDs: []int64{2, 2}})
	if err != nil || res.Moved != 1 {
		t.Fatalf("RetryDead of 2 = %+v, %v; want 1 moved", res, err)
	}
	var id int64
	var jid, queue string
	if err := h.conn.QueryRow(ctx, `SELECT id, jid, queue FROM `+pgx.Identifier{h.schema, "staged_jobs"}.Sanitize()).Scan(&id, &jid, &queue); err != nil ||
		id != 2 || jid != "bbbbbbbbbbbbbbbbbbbbbbbb" || queue != "critical" {
		t.Fatalf("staged after retry: id %d, jid %s, queue %s (%v); want row 2 with its jid and queue", id, jid, queue, err)
	}

	// Inside the caller's transaction, rolled back: nothing moves.
	tx, err := h.conn.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if res, err := admin.RetryDead(ctx, tx, admin.RetryDeadParams{Schema: h.schema, IDs: []int64{1}}); err != nil || res.Moved != 1 {
		t.Fatalf("RetryDead in a transaction = %+v, %v; want 1 moved", res, err)
	}
	if err := tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	if got := deadIDs(t, h.conn, h.schema); !slices.Equal(got, []int64{1, 3, 4}) {
		t.Fatalf("dead after a rolled-back retry: %v, want 1, 3, 4", got)
	}
	// Row 4 has NULL columns staged_jobs refuses: the whole retry fails.
	if _, err := admin.RetryDead(ctx, h.conn, admin.RetryDeadParams{Schema: h.schema, All: true}); err == nil {
		t.Fatal("RetryDead --all with a row staged_jobs refuses succeeded")
	}
	if got := deadIDs(t, h.conn, h.schema); !slices.Equal(got, []int64{1, 3, 4}) {
		t.Fatalf("dead after a failed retry of all: %v, want 1, 3, 4", got)
	}
	if _, err := admin.PurgeDead(ctx, h.conn, admin.PurgeDeadParams{Schema: h.schema, IDs: []int64{4}}); err != nil {
		t.Fatal(err)
	}
	if res, err := admin.RetryDead(ctx, h.conn, admin.RetryDeadParams{Schema: h.schema, All: true}); err != nil || res.Moved != 2 {
		t.Fatalf("RetryDead all = %+v, %v; want 2 moved", res, err)
	}
	if got := deadIDs(t, h.conn, h.schema); len(got) != 0 || h.staged() != 3 {
		t.Fatalf("after retry of all: dead %v, %d staged; want none dead, 3 staged", got, h.staged())
	}
}

// PurgeDead deletes by id, by age or all; an id that is not dead fails it
// and deletes nothing; params that choose nothing, or two ways, or a
// negative age are refused.
func TestPurgeDead(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	h := newHarness(t)
	insertDead(t, h.conn, h.schema)
	s := h.schema
	for _, bad := range []admin.PurgeDeadParams{{Schema: s}, {Schema: s, All: true, OlderThan: time.Hour}, {Schema: s, IDs: []int64{1}, All: true}} {
		if _, err := admin.PurgeDead(ctx, h.conn, bad); !errors.Is(err, admin.ErrNoDeadChosen) {
			t.Errorf("PurgeDead(%+v) = %v, want ErrNoDeadChosen", bad, err)
		}
	}
	if _, err := admin.PurgeDead(ctx, h.conn, admin.PurgeDeadParams{Schema: s, OlderThan: -time.Hour}); err == nil {
		t.Error("PurgeDead with a negative age succeeded")
	}
	purge := func(p admin.PurgeDeadParams, want int64, left ...int64) {
		t.Helper()
		p.Schema = s
		res, err := admin.PurgeDead(ctx, testPool(t), p)
		if err != nil || res.Purged != want {
			t.Fatalf("PurgeDead(%+v) = %+v, %v; want %d purged", p, res, err, want)
		}
		if got := deadIDs(t, h.conn, s); !slices.Equal(got, left) {
			t.Fatalf("after PurgeDead(%+v): dead %v, want %v", p, got, left)
		}
	}
	purge(admin.PurgeDeadParams{OlderThan: 7 * 24 * time.Hour}, 1, 2, 3, 4)
	_, err := admin.PurgeDead(ctx, h.conn, admin.PurgeDeadParams{Schema: s, IDs: []int64{3, 1}})
	var nf *admin.DeadNotFoundError
	if !errors.As(err, &nf) || !slices.Equal(nf.IDs, []int64{1}) {
		t.Fatalf("PurgeDead of 3, 1 = %v, want a DeadNotFoundError for 1", err)
	}
	purge(admin.PurgeDeadParams{OlderThan: 12 * time.Hour}, 1, 3, 4)
	purge(admin.PurgeDeadParams{IDs: []int64{3}}, 1, 4)
	purge(admin.PurgeDeadParams{All: true}, 1)
	purge(admin.PurgeDeadParams{All: true}, 0)
}

// ReadStatus of the sidekiq-staged_push gem's table counts each row under
// the queue the relay would push it to ("default" without one), the poison
// rows apart (in Staged too), and has no dead count.
func TestReadStatusSidekiqStagedPush(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	conn := testenv.Conn(t, testenv.DatabaseURL())
	schema := testenv.Schema(t)
	q := pgx.Identifier{schema}.Sanitize()
	if _, err := conn.Exec(ctx, `CREATE SCHEMA `+q+`;
		CREATE TABLE `+q+`.sidekiq_staged_push_jobs (id bigserial PRIMARY KEY, payload jsonb NOT NULL,
			created_at timestamp(6) NOT NULL, updated_at timestamp(6) NOT NULL);
		INSERT INTO `+q+`.sidekiq_staged_push_jobs (payload, created_at, updated_at) VALUES
			('{"class":"A","args":[1]}', now() AT TIME ZONE 'UTC' - interval '1 minute', now() AT TIME ZONE 'UTC'),
			('{"class":"B","args":[],"queue":"critical"}', now() AT TIME ZONE 'UTC', now() AT TIME ZONE 'UTC'),
			('{"class":"C","args":[],"queue":"critical","at":1.5}', now() AT TIME ZONE 'UTC', now() AT TIME ZONE 'UTC'),
			('{"class":"D","args":[],"jid":""}', now() AT TIME ZONE 'UTC' - interval '1 hour', now() AT TIME ZONE 'UTC')`); err != nil {
		t.Fatal(err)
	}
	st, err := admin.ReadStatus(ctx, conn, admin.StatusParams{Schema: schema, Source: relay.SourceSidekiqStagedPush})
	if err != nil {
		t.Fatal(err)
	}
	if st.Staged != 4 || st.Poison == nil || *st.Poison != 1 || st.Dead != nil || st.Leader != nil ||
		st.OldestAge == nil || *st.OldestAge < 3590 || *st.OldestAge > 3700 {
		t.Errorf("ReadStatus = %+v, want 4 staged (the oldest, poison, about an hour old), 1 poison, no dead count, no leader", st)
	}
	if len(st.Queues) != 2 || st.Queues[0] != (admin.QueueStatus{Queue: "critical", Staged: 2, OldestAge: st.Queues[0].OldestAge}) ||
		st.Queues[1].Queue != "default" || st.Queues[1].Staged != 1 || st.Queues[1].OldestAge < 55 || st.Queues[1].OldestAge > 120 {
		t.Errorf("queues %+v, want critical 2, default 1 (about a minute old)", st.Queues)
	}
}
