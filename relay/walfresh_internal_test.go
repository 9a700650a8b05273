package relay

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/stagedrain/stagedrain/relay/internal/testenv"
)

// A batch's commit reads every WAL position (walPositionsSQL) at a
// leadership's first commit and once walFresh has passed since the last
// such read; in between, the insert position alone, with the flush
// position of that read, or none (0) if the server started since.
func TestCommitReadsTheStandbysOnceAWhile(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	rdb, ns := testenv.Redis(t)
	r, err := New(Config{DatabaseURL: testenv.DatabaseURL(), Redis: rdb, RedisNamespace: ns, Schema: testenv.Name("walfresh")})
	if err != nil {
		t.Fatal(err)
	}
	conn := testenv.Conn(t, testenv.DatabaseURL())
	commit := func(now time.Time) (sql string, wal, flush uint64) {
		t.Helper()
		b := &pgx.Batch{}
		after := r.queueWAL(b, now)
		if len(b.QueuedQueries) != 1 {
			t.Fatalf("queueWAL queued %d statements, want 1", len(b.QueuedQueries))
		}
		if err := conn.SendBatch(ctx, b).Close(); err != nil {
			t.Fatal(err)
		}
		wal, flush = after()
		return b.QueuedQueries[0].SQL, wal, flush
	}

	t0 := time.Now()
	sql, wal0, flush0 := commit(t0)
	if sql != walPositionsSQL || wal0 == 0 || flush0 == 0 || r.walLast.at.IsZero() || r.walLast.read.started.IsZero() || !r.syncKnown {
		t.Fatalf("first commit: read %q, wal %d, flush %d, walAt %v, server started %v; want every position read, and noted", sql, wal0, flush0, r.walLast.at, r.walLast.read.started)
	}
	at := r.walLast.at
	if _, err := conn.Exec(ctx, "SELECT pg_logical_emit_message(false, 'stagedrain-test', 'x')"); err != nil {
		t.Fatal(err) // WAL past the first read, so that the insert position moves
	}
	sql, wal1, flush1 := commit(at.Add(walFresh / 2))
	if sql != walInsertSQL || wal1 <= wal0 || flush1 != flush0 {
		t.Fatalf("commit within walFresh: read %q, wal %d (first %d), flush %d (first %d); want the insert position alone, past the first, and the first flush", sql, wal1, wal0, flush1, flush0)
	}
	if !r.walLast.at.Equal(at) {
		t.Fatalf("a commit within walFresh moved the last full read from %v to %v", at, r.walLast.at)
	}

	// A server that started since the full read (a standby promoted, say)
	// has had no flush position read: the commit counts nothing flushed.
	r.walLast.read.started = r.walLast.read.started.Add(-time.Hour)
	if sql, _, flush := commit(at.Add(walFresh / 2)); sql != walInsertSQL || flush != 0 {
		t.Fatalf("commit within walFresh on a server started since: read %q, flush %d; want the insert position alone, flush 0", sql, flush)
	}

	if sql, _, flush := commit(at.Add(walFresh)); sql != walPositionsSQL || flush == 0 || !r.walLast.at.After(at) {
		t.Fatalf("commit walFresh after the full read: read %q, flush %d, last full read at %v (was %v); want every position read again", sql, flush, r.walLast.at, at)
	}
}
