package main

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/stagedrain/stagedrain/relay"
	"github.com/stagedrain/stagedrain/relay/relaytest"
)

// fleetLocksSQL reads, from one look at pg_locks, each schema's leader
// (the backend holding its leader lock, 'stagedrain:<schema>', a one-key
// lock) and the backends holding a shard of its wake gate
// ('stagedrain-idle:<schema>', a two-key lock, held by a leader while it
// is idle), each named by its application_name.
const fleetLocksSQL = `WITH l AS MATERIALIZED (
		SELECT l.pid, l.classid::bigint AS classid, l.objid::bigint AS objid, l.objsubid, l.mode
		FROM pg_locks l
		WHERE l.locktype = 'advisory' AND l.granted
		  AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())),
	k AS (SELECT s AS schema, hashtextextended('stagedrain:' || s, 0) AS lead,
		(hashtext('stagedrain-idle:' || s)::bigint + 4294967296) % 4294967296 AS idle
		FROM unnest($1::text[]) s)
	SELECT k.schema,
		coalesce((SELECT min(l.pid) FROM l WHERE l.objsubid = 1 AND l.mode = 'ExclusiveLock'
			AND l.classid = (k.lead >> 32) & 4294967295 AND l.objid = k.lead & 4294967295), 0),
		coalesce((SELECT array_agg(DISTINCT l.pid ORDER BY l.pid) FROM l
			WHERE l.objsubid = 2 AND l.mode = 'ExclusiveLock' AND l.classid = k.idle), '{}'),
		coalesce((SELECT string_agg(DISTINCT a.pid || ' ' || a.application_name, ', ') FROM l JOIN pg_stat_activity a USING (pid)
			WHERE l.objsubid = 2 AND l.classid = k.idle), '')
	FROM k ORDER BY 1`

type schemaLocks struct {
	schema string
	leader int32   // 0: nobody
	idle   []int32 // the backends holding a shard of its gate
	who    string  // those backends' application_names
}

func (d *defaultsEnv) fleetLocks(schemas []string) []schemaLocks {
	d.t.Helper()
	rows, err := d.conn.Query(context.Background(), fleetLocksSQL, schemas)
	if err != nil {
		d.t.Fatalf("read pg_locks: %v", err)
	}
	out, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (schemaLocks, error) {
		var s schemaLocks
		err := row.Scan(&s.schema, &s.leader, &s.idle, &s.who)
		return s, err
	})
	if err != nil {
		d.t.Fatalf("read pg_locks: %v", err)
	}
	return out
}

// staged counts the rows left in schema's staged_jobs.
func (d *defaultsEnv) staged(schema string) int {
	d.t.Helper()
	var n int
	if err := d.conn.QueryRow(context.Background(), "SELECT count(*) FROM "+pgx.Identifier{schema, "staged_jobs"}.Sanitize()).Scan(&n); err != nil {
		d.t.Fatalf("count %s's staged rows: %v", schema, err)
	}
	return n
}

// Two `stagedrain run --schemas s1,s2,s3,s4 --poll-interval 5s` on one
// host (nothing else but DATABASE_URL and REDIS_URL), a long backlog in
// s1, s2 and s3, none in s4: the first leads all four, and when the second
// starts it lets the last two go, s3 while it is draining it (awake) and
// s4 idle, holding its wake gate ('idle'). Its lock connection stays open
// for the two it keeps, and must not keep the gate of those it let go:
// else their commits would notify a process that no longer drains them,
// and the new leader could never go idle (its lock would only time out),
// so a job would wait for the 5s poll. After the split no process holds
// the gate of a schema it does not lead, each leader, idle, holds its own
// schemas', and a single job in every schema is delivered by its NOTIFY,
// far sooner than the poll.
func TestDefaultsFleetWakeGateAfterSplit(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	d := newDefaultsEnv(t)
	schemas := []string{"s1", "s2", "s3", "s4"}
	// Enough that the first relay is still draining s3 when the second
	// joins (the case); the test checks that it was. s4 has none:
	// its leader is idle from its first drain on.
	const rows = 60_000
	staged := map[string]int{"s1": rows, "s2": rows, "s3": rows, "s4": 0}
	total := 0
	for _, s := range schemas {
		if _, err := relay.Migrate(ctx, d.conn, s); err != nil {
			t.Fatal(err)
		}
		if _, err := d.conn.Exec(ctx, "INSERT INTO "+pgx.Identifier{s, "staged_jobs"}.Sanitize()+
			" (job_name, job_args) SELECT 'Bulk', '[1]' FROM generate_series(1, $1)", staged[s]); err != nil {
			t.Fatalf("stage %d rows in %s: %v", staged[s], s, err)
		}
		total += staged[s]
	}
	args := []string{"--schemas", strings.Join(schemas, ","), "--poll-interval", "5s"}
	a := d.start("relay a", args...)
	a.failTail = 60
	waitLines(t, a, "became leader", 4)
	relaytest.WaitFor(t, 10*time.Second, "s4's leader idle (holding its wake gate)", func() (bool, string) {
		l := d.fleetLocks([]string{"s4"})[0]
		return l.leader != 0 && len(l.idle) == 1 && l.idle[0] == l.leader, fmt.Sprintf("led by %d, held by %s", l.leader, l.who)
	})
	b := d.start("relay b", args...)
	b.failTail = 60

	// What each schema the first relay lets go still holds as it does.
	letGo := map[string]int{}
	for len(letGo) < 2 {
		ln, err := a.stdout.wait(60*time.Second, func(l logLine) bool {
			_, seen := letGo[l.str("schema")]
			return l.is(rootLogger, "letting a schema go to another member of the fleet") && !seen
		})
		if err != nil {
			t.Fatalf("relay a let %d schemas go (%v), want 2: %v", len(letGo), letGo, err)
		}
		letGo[ln.str("schema")] = d.staged(ln.str("schema"))
	}
	waitLines(t, b, "became leader", 2)
	waitLines(t, a, "released leadership", 2)
	checkUp(t, a, b)
	if _, ok := letGo["s4"]; !ok || letGo["s3"] == 0 {
		t.Fatalf("relay a let go of %v (rows still staged then): the case needs s3 let go mid-drain and s4 idle; stage more rows", letGo)
	}
	t.Logf("relay a let go of (rows still staged then): %v", letGo)

	relaytest.WaitFor(t, 3*time.Minute, "every row delivered", func() (bool, string) {
		left := map[string]int{}
		for _, s := range schemas {
			if n := d.staged(s); n > 0 {
				left[s] = n
			}
		}
		n, err := d.rdb.LLen(ctx, "queue:default").Result()
		return len(left) == 0 && err == nil && n == int64(total), fmt.Sprintf("staged %v, queue:default %d (%v)", left, n, err)
	})
	checkUp(t, a, b)

	// The split: each process leads two schemas, and holds no wake gate
	// of a schema it does not lead (idle, it holds those it leads).
	locks := d.fleetLocks(schemas)
	perLeader := map[int32][]string{}
	for _, s := range locks {
		perLeader[s.leader] = append(perLeader[s.leader], s.schema)
		for _, pid := range s.idle {
			if pid != s.leader {
				t.Errorf("schema %s is led by backend %d, and its wake gate is held by %d (idle holders: %s)", s.schema, s.leader, pid, s.who)
			}
		}
	}
	if len(perLeader) != 2 || perLeader[0] != nil {
		t.Errorf("leaders %v, want two lock connections of two schemas each", perLeader)
	}
	if t.Failed() {
		t.FailNow()
	}

	// A single job in each schema: its commit notifies, and the relay that
	// leads the schema delivers it long before a poll (5s, jittered by
	// 25%) could.
	if err := d.rdb.Del(ctx, "queue:default").Err(); err != nil {
		t.Fatal(err)
	}
	listener := relaytest.Conn(t, d.databaseURL)
	for _, s := range schemas {
		if _, err := listener.Exec(ctx, "LISTEN "+pgx.Identifier{relay.ChannelName(s)}.Sanitize()); err != nil {
			t.Fatal(err)
		}
	}
	looks := relaytest.Conn(t, d.databaseURL)
	var took []string
	for _, s := range schemas {
		jids, start := d.commitNotifying(listener, looks, s)
		// Every job committed is delivered, and the one whose commit
		// notified long before a poll.
		notified, latency := jids[len(jids)-1], time.Duration(0)
		pending := slices.Clone(jids)
		for len(pending) > 0 {
			got, err := d.rdb.BRPop(ctx, 10*time.Second, "queue:default").Result()
			if err != nil {
				t.Fatalf("schema %s: jobs %v were not delivered within 10s: %v", s, pending, err)
			}
			i := slices.IndexFunc(pending, func(jid string) bool { return strings.Contains(got[1], jid) })
			if i < 0 {
				t.Fatalf("schema %s: delivered %s, want one of the jids %v", s, got[1], pending)
			}
			if pending[i] == notified {
				latency = time.Since(start)
			}
			pending = slices.Delete(pending, i, i+1)
		}
		took = append(took, fmt.Sprintf("%s %s", s, latency.Round(time.Millisecond)))
		if latency >= 2*time.Second {
			t.Errorf("schema %s: one job took %s from commit to Redis, want well under the 5s poll (NOTIFY)", s, latency)
		}
	}
	t.Logf("one job at a time after the split: %s", strings.Join(took, ", "))
	checkUp(t, a, b)
}

// commitNotifying commits one job in schema once its leader is idle (its
// lock connection alone holds the schema's wake gate), and checks that the
// commit notifies listener, LISTENing on the schema's channel. It returns
// the jids of the jobs it committed, the last the one whose commit
// notified, and when that commit began.
//
// A leader leaves idle now and then by itself on a busy machine (a push
// that takes over 100ms marks it awake, its listener goes deaf, the fleet
// runs hot), and a commit made then rightly does not notify: its drain
// finds the row. So a commit that did not notify fails the test at once
// only when the leader provably was idle throughout it: its lock
// connection held the gate, and ran no statement from a look at
// pg_stat_activity (on looks) before the commit to one after it (the
// relay takes and gives back the gate only with statements on that
// connection). Otherwise the commit is tried again, up to five.
func (d *defaultsEnv) commitNotifying(listener, looks *pgx.Conn, schema string) (jids []string, start time.Time) {
	t := d.t
	t.Helper()
	var tries []string
	for try := 1; ; try++ {
		var l schemaLocks
		relaytest.WaitFor(t, 10*time.Second, schema+"'s leader idle (holding its wake gate, alone)", func() (bool, string) {
			l = d.fleetLocks([]string{schema})[0]
			return l.leader != 0 && len(l.idle) == 1 && l.idle[0] == l.leader, fmt.Sprintf("led by %d, held by %s", l.leader, l.who)
		})
		before := relaytest.SessionStateOf(t, looks, uint32(l.leader))
		still := d.fleetLocks([]string{schema})[0]
		start = time.Now()
		jids = append(jids, d.stageIn(schema))
		after := relaytest.SessionStateOf(t, looks, uint32(l.leader))
		if notifiedBy(t, listener, relay.ChannelName(schema), d.conn.PgConn().PID(), 3*time.Second) {
			return jids, start
		}
		tries = append(tries, fmt.Sprintf("%d: lock connection %d %s, then %s; the gate held by %v after the first look",
			try, l.leader, before, after, still.idle))
		if still.leader == l.leader && slices.Equal(still.idle, []int32{l.leader}) && before.State == "idle" && after == before {
			t.Errorf("schema %s: the commit of one job sent no NOTIFY within 3s, though its leader was idle throughout: its lock connection %d held the wake gate and ran no statement from before the commit to after it; commits: %s",
				schema, l.leader, strings.Join(tries, "; "))
			return jids, start
		}
		if try == 5 {
			t.Errorf("schema %s: none of %d commits of one job sent a NOTIFY within 3s, its leader not provably idle around any: %s", schema, try, strings.Join(tries, "; "))
			return jids, start
		}
		t.Logf("schema %s: commit %d of one job sent no NOTIFY within 3s, and its leader may have left idle around it (%s): try again", schema, try, tries[len(tries)-1])
	}
}

// notifiedBy waits up to timeout for a notification on channel from the
// backend pid, past any other.
func notifiedBy(t *testing.T, listener *pgx.Conn, channel string, pid uint32, timeout time.Duration) bool {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	for {
		n, err := listener.WaitForNotification(ctx)
		if err != nil {
			return false
		}
		if n.Channel == channel && n.PID == pid {
			return true
		}
	}
}
