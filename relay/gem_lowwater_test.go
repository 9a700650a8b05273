package relay_test

import (
	"context"
	"fmt"
	"math"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/stagedrain/stagedrain/relay"
	"github.com/stagedrain/stagedrain/relay/internal/testenv"
)

// The low-water mark on the sidekiq-staged_push gem's table (sql/gem_002.sql):
// a statement trigger gives each INSERT its transaction id before the id's
// default draws from the sequence.

// migrateGem runs migrate --source sidekiq_staged_push on h's schema.
func (h *harness) migrateGem() {
	h.t.Helper()
	if _, err := relay.Migrate(context.Background(), h.conn, h.schema, relay.WithSource(relay.SourceSidekiqStagedPush)); err != nil {
		h.t.Fatalf("migrate --source sidekiq_staged_push: %v", err)
	}
}

// maxGemID is the highest id the gem's table has handed out.
func (h *harness) maxGemID() int64 { return h.lastValue("sidekiq_staged_push_jobs_id_seq") }

// pushGemRows inserts n rows into the gem's table, 100 to a statement.
func (h *harness) pushGemRows(n int) {
	h.t.Helper()
	for n > 0 {
		k := min(n, 100)
		if _, err := h.conn.Exec(context.Background(), `INSERT INTO `+h.gemTable()+` (payload, created_at, updated_at)
			SELECT json_build_object('class', 'HardWorker', 'args', json_build_array(i)), now() AT TIME ZONE 'UTC', now() AT TIME ZONE 'UTC'
			FROM generate_series(1, $1) i`, k); err != nil {
			h.t.Fatal(err)
		}
		n -= k
	}
}

// Every way an app inserts takes the transaction id before the id's
// default runs: a column whose default records whether the transaction had
// one says so, where without the trigger it did not.
func TestGemXidFirstBeforeDefault(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	h := newStagedPushHarness(t)
	table := h.gemTable()
	if _, err := h.conn.Exec(ctx, `ALTER TABLE `+table+` ADD COLUMN had_xid boolean DEFAULT (pg_current_xact_id_if_assigned() IS NOT NULL)`); err != nil {
		t.Fatal(err)
	}
	ways := map[string]func() error{
		"INSERT ... VALUES": func() error {
			_, err := h.conn.Exec(ctx, `INSERT INTO `+table+` (payload, created_at, updated_at) VALUES ('{}', now(), now())`)
			return err
		},
		"INSERT ... SELECT": func() error {
			_, err := h.conn.Exec(ctx, `INSERT INTO `+table+` (payload, created_at, updated_at) SELECT '{}', now(), now() FROM generate_series(1, 3)`)
			return err
		},
		"INSERT ... ON CONFLICT": func() error {
			_, err := h.conn.Exec(ctx, `INSERT INTO `+table+` (payload, created_at, updated_at) VALUES ('{}', now(), now()) ON CONFLICT DO NOTHING`)
			return err
		},
		"COPY FROM": func() error {
			_, err := h.conn.CopyFrom(ctx, pgx.Identifier{h.schema, "sidekiq_staged_push_jobs"}, []string{"payload", "created_at", "updated_at"},
				pgx.CopyFromRows([][]any{{"{}", time.Now(), time.Now()}, {"{}", time.Now(), time.Now()}}))
			return err
		},
	}
	// Each way, in a transaction of its own, more than 32 times: nextval()
	// takes a transaction id itself once in 32 values (when it logs ahead).
	without := func() (rows, had int) {
		t.Helper()
		if _, err := h.conn.Exec(ctx, `TRUNCATE `+table); err != nil {
			t.Fatal(err)
		}
		for name, insert := range ways {
			for range 40 {
				if err := insert(); err != nil {
					t.Fatalf("%s: %v", name, err)
				}
			}
		}
		if err := h.conn.QueryRow(ctx, `SELECT count(*), count(*) FILTER (WHERE had_xid) FROM `+table).Scan(&rows, &had); err != nil {
			t.Fatal(err)
		}
		return rows, had
	}
	rows, had := without()
	if had == rows {
		t.Fatalf("without the trigger, all %d rows' defaults ran with a transaction id: this test cannot tell", rows)
	}
	h.migrateGem()
	if rows, had = without(); had != rows {
		var which []string
		r, err := h.conn.Query(ctx, `SELECT id::text FROM `+table+` WHERE NOT had_xid ORDER BY id LIMIT 10`)
		if err == nil {
			which, _ = pgx.CollectRows(r, pgx.RowTo[string])
		}
		t.Fatalf("with the stagedrain_xid_first trigger, %d of %d rows' ids were drawn before their transaction had an id (ids %v)", rows-had, rows, which)
	}
}

// A row whose id was drawn, in a transaction that has not yet written it,
// before higher ids were drained is still drained when that transaction
// commits: the statement trigger gave it a transaction id first, so the
// mark stays below it. The app's INSERT is held between its id's default
// and its row (a row trigger waits on a lock the test holds), the one
// moment a transaction without the trigger holds an id and no transaction
// id; the probe is off and the poll an hour away.
func TestGemLateLowIDIsDrainedAboveTheMark(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	h := newStagedPushHarness(t)
	h.migrateGem()
	// The test's own row trigger: a row of class "Held" waits for lock k.
	var k int64
	if err := h.conn.QueryRow(ctx, `SELECT hashtext($1)`, "gem-late:"+h.schema).Scan(&k); err != nil {
		t.Fatal(err)
	}
	if _, err := h.conn.Exec(ctx, fmt.Sprintf(`
		CREATE FUNCTION %[1]s.hold_late() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN
			IF NEW.payload->>'class' = 'Held' THEN
				PERFORM pg_advisory_lock(%[2]d);
				PERFORM pg_advisory_unlock(%[2]d);
			END IF;
			RETURN NEW;
		END $$;
		CREATE TRIGGER hold_late BEFORE INSERT ON %[3]s FOR EACH ROW EXECUTE FUNCTION %[1]s.hold_late()`,
		pgx.Identifier{h.schema}.Sanitize(), k, h.gemTable())); err != nil {
		t.Fatal(err)
	}
	cfg := h.config()
	cfg.Source = relay.SourceSidekiqStagedPush
	cfg.PollInterval = time.Hour
	r, err := relay.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	relay.SetProbeEvery(r, time.Hour)
	idle := idleEvents(r)
	h.run(r)
	h.pushStaged(`{"class":"First","args":[]}`)
	h.waitGemQueueLen("default", 1, 15*time.Second)
	waitMark(t, r, h.maxGemID())

	holder := testenv.Conn(t, testenv.DatabaseURL())
	if _, err := holder.Exec(ctx, `SELECT pg_advisory_lock($1)`, k); err != nil {
		t.Fatal(err)
	}
	late := testenv.Conn(t, testenv.DatabaseURL())
	var latePID uint32
	if err := late.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&latePID); err != nil {
		t.Fatal(err)
	}
	lateDone := make(chan error, 1)
	go func() {
		lateDone <- pgx.BeginFunc(ctx, late, func(tx pgx.Tx) error {
			_, err := tx.Exec(ctx, `INSERT INTO `+h.gemTable()+` (payload, created_at, updated_at)
				VALUES ('{"class":"Held","args":[]}', now() AT TIME ZONE 'UTC', now() AT TIME ZONE 'UTC')`)
			return err
		})
	}()
	// The INSERT has drawn its id and waits in the row trigger.
	testenv.WaitFor(t, 15*time.Second, "the late INSERT waiting on the test's lock", func() (bool, string) {
		var waiting bool
		err := h.conn.QueryRow(ctx, `SELECT EXISTS (SELECT FROM pg_locks WHERE pid = $1 AND locktype = 'advisory' AND NOT granted)`, latePID).Scan(&waiting)
		return err == nil && waiting, fmt.Sprintf("waiting: %v, err: %v", waiting, err)
	})
	lateID := h.maxGemID()
	later := make([]string, 20)
	for i := range later {
		later[i] = `{"class":"After","args":[]}`
	}
	for _, p := range later {
		h.pushStaged(p)
	}
	h.waitGemQueueLen("default", 21, 15*time.Second)
	h.waitIdleAfterListen(idle)
	// Drained and idle: every claim since could have moved the mark.
	if l, _ := relay.LowWater(r); l >= lateID {
		t.Fatalf("low-water mark %d passed id %d, whose INSERT has not written its row yet", l, lateID)
	}
	if _, err := holder.Exec(ctx, `SELECT pg_advisory_unlock($1)`, k); err != nil {
		t.Fatal(err)
	}
	if err := <-lateDone; err != nil {
		t.Fatalf("the late INSERT: %v", err)
	}
	h.waitGemQueueLen("default", 22, 15*time.Second)
	jobs, err := h.rdb.LRange(ctx, h.key("queue:default"), 0, -1).Result()
	if err != nil {
		t.Fatal(err)
	}
	if n := strings.Count(strings.Join(jobs, "\n"), `"class":"Held"`); n != 1 {
		t.Fatalf("%d Held jobs in queue:default, want 1", n)
	}
	waitMark(t, r, lateID)
}

// With the xmin horizon held, the relay's claims on the gem's table start
// at the low-water mark and touch as many buffers after 22,000 dead rows
// as after 2,000, where a claim from the index's start touches ten times
// more (TestClaimCostDoesNotGrowWithDeadRows, for staged_jobs).
func TestGemClaimCostDoesNotGrowWithDeadRows(t *testing.T) {
	h, pg := privateHarness(t, "autovacuum=off")
	if _, err := h.conn.Exec(context.Background(), gemTableSQL(t, h.schema)); err != nil {
		t.Fatal(err)
	}
	h.migrateGem()
	cfg := h.config()
	cfg.DatabaseURL = pg.URL()
	cfg.Source = relay.SourceSidekiqStagedPush
	r := h.start(cfg)
	holdHorizon(t, pg.URL())

	var total int64
	phase := func(n int) (fromMark, fromIndexStart int64) {
		t.Helper()
		h.pushGemRows(n)
		total += int64(n)
		h.waitQueueLen("default", total, 60*time.Second)
		top := h.maxGemID()
		waitMark(t, r, top)
		testenv.WaitFor(t, 15*time.Second, "a claim from the mark at the last id", func() (bool, string) {
			from := relay.LastClaimFrom(r)
			return from >= top, fmt.Sprintf("last claim from %d, last id %d", from, top)
		})
		return h.claimBuffers(r, relay.LastClaimFrom(r)), h.claimBuffers(r, math.MinInt64)
	}
	earlyMark, earlyStart := phase(2000)
	lateMark, lateStart := phase(20000)
	t.Logf("claim buffers: from the mark %d -> %d, from the index's start %d -> %d", earlyMark, lateMark, earlyStart, lateStart)
	horizonHeld(t, earlyStart, lateStart)
	costFlat(t, "the relay's claim", earlyMark, lateMark)
}
