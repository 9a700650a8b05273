package relay

import (
	"context"
	"encoding/json"
	"flag"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/stagedrain/stagedrain/relay/internal/golden"
	"github.com/stagedrain/stagedrain/relay/internal/handoff"
	targets "github.com/stagedrain/stagedrain/relay/internal/target"
	"github.com/stagedrain/stagedrain/relay/internal/testenv"
)

// update makes the golden tests rewrite their files instead of comparing:
// go test ./... -update. Every test package of the module defines it (the
// go command passes it to each).
var update = flag.Bool("update", false, "rewrite the golden files in testdata/ at the top of the module")

// The golden files, ../testdata/*.json, are what each target writes for
// fixed rows at a fixed time (relay/internal/golden has the harness). The
// targets' own golden tests are in relay/internal/target; these are the
// ones that need the relay: rows as its sources read them.

type (
	goldenFile = golden.File
	goldenOp   = golden.Op
)

// The fixed times and jid of the golden rows.
var (
	goldenCreated = golden.Created
	goldenNow     = golden.Now
	goldenLater   = golden.Later
)

const goldenJID = golden.JID

func rowsOf(jobs []stagedJob) []golden.Row {
	out := make([]targets.Job, len(jobs))
	for i, j := range jobs {
		out[i] = targets.Job{ID: j.id, Name: j.name, Args: j.args, Queue: j.queue, RunAt: j.runAt, JID: j.jid,
			CreatedAt: j.createdAt, Options: j.options}
	}
	return golden.Rows(out)
}

func opsOf(t *testing.T, u *handoff.Unit) []goldenOp { t.Helper(); return golden.Ops(t, u) }

// checkGolden compares f with ../testdata/<name>, or writes it there under
// -update.
func checkGolden(t *testing.T, name string, f goldenFile) {
	t.Helper()
	golden.Check(t, "..", name, f, *update)
}

// build runs target over jobs as a push at goldenNow would, and returns
// the ops it built; no row may be rejected.
func build(t *testing.T, tg target, jobs []stagedJob) []goldenOp {
	t.Helper()
	var u handoff.Unit
	var res pushResult
	tg.add(&u, jobs, goldenNow, &res)
	if len(res.rejected) > 0 {
		t.Fatalf("rejected: %v", res.rejected)
	}
	return opsOf(t, &u)
}

// builtin is the target named name, made by its Spec's New with o, as
// newTarget makes it from a Config.
func builtin(name Target, o targets.Options) target { return newSpecTarget(name.spec(), o) }

func goldenJob(id int64, name, args, queue string, runAt *time.Time, options string) stagedJob {
	j := golden.Job(id, name, args, queue, runAt, options)
	return stagedJob{id: j.ID, name: j.Name, args: j.Args, queue: j.Queue, runAt: j.RunAt, jid: j.JID,
		createdAt: j.CreatedAt, options: j.Options}
}

// The seed article's table has three columns, id, job_name and job_args,
// and its app INSERTs the last two. stagedrain has no source for a table of
// only those: its staged_jobs has them and more, each with a default, so
// the article's INSERTs stage rows into it as they are. The test runs them
// against Migrate's table and checks the defaults the golden rows show
// (jid and created_at are fixed in the golden; the table draws a random jid
// and takes now()).
func TestGoldenArticleTable(t *testing.T) {
	t.Parallel()
	article := map[string]any{
		"article_table": "CREATE TABLE staged_jobs (\n    id       BIGSERIAL PRIMARY KEY,\n    job_name TEXT      NOT NULL,\n    job_args JSONB     NOT NULL\n);",
		"inserts": []string{
			`INSERT INTO staged_jobs (job_name, job_args) VALUES ('WelcomeEmail', '[42]')`,
			`INSERT INTO staged_jobs (job_name, job_args) VALUES ('ChargeCard', '[42, 1999, "usd"]')`,
		},
		"note": "stagedrain's staged_jobs holds the article's three columns and more (queue, run_at, jid, created_at, options), each with a default, so the article's INSERTs stage these rows; the golden fixes jid and created_at, which the table draws at random and from now()",
	}
	ctx := context.Background()
	conn := testenv.Conn(t, testenv.DatabaseURL())
	schema := testenv.Schema(t)
	if _, err := Migrate(ctx, conn, schema); err != nil {
		t.Fatal(err)
	}
	if _, err := conn.Exec(ctx, "SET search_path = "+pgx.Identifier{schema}.Sanitize()); err != nil {
		t.Fatal(err)
	}
	for _, ins := range article["inserts"].([]string) {
		if _, err := conn.Exec(ctx, ins); err != nil {
			t.Fatalf("%s: %v", ins, err)
		}
	}
	rows, err := conn.Query(ctx, `SELECT job_name, job_args::text, queue, run_at, options::text, jid ~ '^[0-9a-f]{24}$',
		created_at > now() - interval '1 minute' FROM staged_jobs ORDER BY id`)
	if err != nil {
		t.Fatal(err)
	}
	var jobs []stagedJob
	for rows.Next() {
		var j stagedJob
		var hexJID, recent bool
		if err := rows.Scan(&j.name, &j.args, &j.queue, &j.runAt, &j.options, &hexJID, &recent); err != nil {
			t.Fatal(err)
		}
		if !hexJID || !recent {
			t.Fatalf("row %s: jid of 24 hex digits %v, created_at now %v; want both", j.name, hexJID, recent)
		}
		jobs = append(jobs, j)
	}
	if rows.Err() != nil {
		t.Fatal(rows.Err())
	}
	want := []stagedJob{
		goldenJob(1, "WelcomeEmail", `[42]`, "default", nil, `{}`),
		goldenJob(2, "ChargeCard", `[42, 1999, "usd"]`, "default", nil, `{}`),
	}
	if len(jobs) != len(want) {
		t.Fatalf("%d rows staged, want %d", len(jobs), len(want))
	}
	for i, j := range jobs {
		w := want[i]
		if j.name != w.name || string(j.args) != string(w.args) || j.queue != w.queue || j.runAt != nil || string(j.options) != string(w.options) {
			t.Errorf("row %d as staged: %s %s queue %s run_at %v options %s; the golden has %s %s queue %s run_at NULL options %s",
				i+1, j.name, j.args, j.queue, j.runAt, j.options, w.name, w.args, w.queue, w.options)
		}
	}
	checkGolden(t, "article_table.json", goldenFile{
		Case:   "The seed article's three-column table: its INSERTs, the staged_jobs rows they make, and what the Sidekiq target (float seconds) writes for them",
		Target: "sidekiq", Timestamps: string(TimestampSeconds), Now: goldenNow, Source: article,
		Rows: rowsOf(want), Ops: build(t, builtin(TargetSidekiq, targets.Options{MaxPayload: 1 << 20}), want)})
}

// Rows as the sidekiq-staged_push gem stores them (its table
// sidekiq_staged_push_jobs: payload, a Sidekiq job hash as JSON, and Rails'
// timestamps), as the relay reads them (mapStagedPush), and what the
// Sidekiq target writes for them.
func TestGoldenStagedPushRows(t *testing.T) {
	t.Parallel()
	type gemRow struct {
		ID        int64           `json:"id"`
		Payload   json.RawMessage `json:"payload"`
		CreatedAt string          `json:"created_at"`
		UpdatedAt string          `json:"updated_at"`
	}
	created := goldenCreated.Format("2006-01-02T15:04:05.999999")
	gem := []gemRow{
		{1, json.RawMessage(`{"class":"WelcomeJob","args":[42,"ada@example.com"],"queue":"default","jid":"` + goldenJID + `","retry":true,"created_at":1795953600.5}`), created, created},
		{2, json.RawMessage(`{"class":"ReminderJob","args":[42],"queue":"mailers","jid":"0123456789abcdef01234502","retry":3,"at":1795959000.25,"created_at":1795953600500}`), created, created},
		{3, json.RawMessage(`{"class":"AuditJob","args":[],"jid":"0123456789abcdef01234503","tags":["audit"]}`), created, created},
	}
	var jobs []stagedJob
	for _, r := range gem {
		epoch := float64(goldenCreated.UnixMicro()) / 1e6
		j := stagedJob{id: r.ID}
		mapStagedPush(&j, r.Payload, &epoch, goldenNow)
		if j.bad != "" {
			t.Fatalf("gem row %d: %s", r.ID, j.bad)
		}
		jobs = append(jobs, j)
	}
	checkGolden(t, "sidekiq_staged_push_rows.json", goldenFile{
		Case:   "Rows of sidekiq_staged_push_jobs as the gem stores them (payload: the Sidekiq job hash; created_at in seconds or, from Sidekiq 8, milliseconds; queue default when missing), the rows the relay reads from them, and what the Sidekiq target (float seconds) writes",
		Target: "sidekiq", Timestamps: string(TimestampSeconds), Now: goldenNow, Source: map[string]any{"sidekiq_staged_push_jobs": gem},
		Rows: rowsOf(jobs), Ops: build(t, builtin(TargetSidekiq, targets.Options{MaxPayload: 1 << 20}), jobs)})
}
