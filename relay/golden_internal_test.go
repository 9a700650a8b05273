package relay

import (
	"bytes"
	"context"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/jackc/pgx/v5"
	"google.golang.org/protobuf/encoding/protowire"

	"github.com/stagedrain/stagedrain/relay/internal/handoff"
	targets "github.com/stagedrain/stagedrain/relay/internal/target"
	"github.com/stagedrain/stagedrain/relay/internal/testenv"
)

// update makes the golden tests rewrite their files instead of comparing:
// go test ./... -update. Every test package of the module defines it (the
// go command passes it to each).
var update = flag.Bool("update", false, "rewrite the golden files in testdata/ at the top of the module")

// The golden files, ../testdata/*.json, are what each target writes for
// fixed rows at a fixed time: for each op of the push (the rows it
// delivers, and the keys whose existence skips it), each Redis command with
// its key and arguments exactly as Redis receives them, and beside them
// what those arguments hold, decoded: a Sidekiq payload as JSON, an asynq
// TaskMessage's protobuf fields by name. The relay's own bookkeeping in the
// same script (the handoff record, handoff.go) is not shown.

// The fixed times and jid of the golden rows.
var (
	goldenCreated = time.Date(2026, 11, 29, 12, 0, 0, 500_000_000, time.UTC)
	goldenNow     = goldenCreated.Add(2 * time.Second)
	goldenLater   = time.Date(2026, 11, 29, 13, 30, 0, 250_000_000, time.UTC)
)

const goldenJID = "0123456789abcdef01234567"

type goldenFile struct {
	Case       string          `json:"case"`
	Target     string          `json:"target"`
	Timestamps TimestampFormat `json:"timestamps,omitempty"`
	// TenantKey and Schema: with Config.TenantKey, the key and the schema
	// the rows were staged in (tenant.go).
	TenantKey string    `json:"tenant_key,omitempty"`
	Schema    string    `json:"schema,omitempty"`
	Now       time.Time `json:"now"`
	// Source is how the rows were staged, where they are not staged_jobs'
	// own: the article's table and INSERTs, or the gem's rows.
	Source any         `json:"source,omitempty"`
	Rows   []goldenRow `json:"rows"`
	Ops    []goldenOp  `json:"ops"`
}

// goldenRow is a row of staged_jobs as the relay reads it.
type goldenRow struct {
	ID        int64           `json:"id"`
	JobName   string          `json:"job_name"`
	JobArgs   json.RawMessage `json:"job_args"`
	Queue     string          `json:"queue"`
	RunAt     *time.Time      `json:"run_at"`
	JID       string          `json:"jid"`
	CreatedAt time.Time       `json:"created_at"`
	Options   json.RawMessage `json:"options"`
}

type goldenOp struct {
	// Rows are the ids of the rows the op delivers; none for bookkeeping
	// (a queue set), whose failure matters to no row.
	Rows         []int64         `json:"rows"`
	SkipIfExists []string        `json:"skip_if_exists,omitempty"`
	Commands     []goldenCommand `json:"commands"`
}

type goldenCommand struct {
	Command string `json:"command"`
	Key     string `json:"key"`
	// Keys are the keys of a command on several (a Lua op's), Key the
	// first of them.
	Keys []string `json:"keys,omitempty"`
	// Args are the arguments as Redis receives them: text as a string,
	// binary (asynq's protobuf msg) as {"hex": ...}.
	Args []any `json:"args"`
	// Decoded holds what an argument holds, by its index in args.
	Decoded map[string]any `json:"decoded,omitempty"`
}

func rowsOf(jobs []stagedJob) []goldenRow {
	var out []goldenRow
	for _, j := range jobs {
		var runAt *time.Time
		if j.runAt != nil {
			t := j.runAt.UTC()
			runAt = &t
		}
		out = append(out, goldenRow{ID: j.id, JobName: j.name, JobArgs: j.args, Queue: j.queue, RunAt: runAt,
			JID: j.jid, CreatedAt: j.createdAt.UTC(), Options: j.options})
	}
	return out
}

// opsOf reads the commands a target built into u back out of the script's
// KEYS and ARGV layout, as the handoff reads it (handoff.Unit.Commands).
func opsOf(t *testing.T, u *handoff.Unit) []goldenOp {
	t.Helper()
	var out []goldenOp
	for i, op := range u.Ops() {
		guards, cmds := u.Commands(i)
		g := goldenOp{Rows: append([]int64{}, op.IDs...), SkipIfExists: guards}
		for _, cmd := range cmds {
			c := goldenCommand{Command: cmd.Name, Key: cmd.Keys[0]}
			if len(cmd.Keys) > 1 {
				c.Keys = cmd.Keys
			}
			var wire []string
			for _, arg := range cmd.Args {
				wire = append(wire, wireArg(t, arg))
			}
			decode(t, &c, wire)
			g.Commands = append(g.Commands, c)
		}
		out = append(out, g)
	}
	return out
}

// wireArg is arg as go-redis sends it (its appendArg).
func wireArg(t *testing.T, arg any) string {
	switch v := arg.(type) {
	case string:
		return v
	case []byte:
		return string(v)
	case int:
		return strconv.Itoa(v)
	case int64:
		return strconv.FormatInt(v, 10)
	case float64:
		return strconv.FormatFloat(v, 'f', -1, 64)
	}
	t.Fatalf("argument %v of type %T: add it to wireArg", arg, arg)
	return ""
}

// decode sets c.Args from wire, and c.Decoded: JSON payloads (Sidekiq's
// LPUSH values and ZADD members) and asynq's msg.
func decode(t *testing.T, c *goldenCommand, wire []string) {
	t.Helper()
	set := func(i int, v any) {
		if c.Decoded == nil {
			c.Decoded = make(map[string]any)
		}
		c.Decoded[strconv.Itoa(i)] = v
	}
	for i, arg := range wire {
		switch {
		case c.Command == "HSET" && i%2 == 1 && wire[i-1] == "msg":
			c.Args = append(c.Args, map[string]string{"hex": hex.EncodeToString([]byte(arg))})
			set(i, decodeTaskMessage(t, []byte(arg)))
			continue
		case c.Command == "bullmq.add" && (i == 3 || i == 4): // data, opts
			set(i, json.RawMessage(arg))
		case c.Command == "LPUSH" || c.Command == "ZADD" && i%2 == 1:
			if strings.HasPrefix(arg, "{") && json.Valid([]byte(arg)) {
				set(i, decodeEnvelope(t, arg))
			}
		}
		if !utf8.ValidString(arg) {
			t.Fatalf("%s %s: argument %d is not text: show it as hex", c.Command, c.Key, i)
		}
		c.Args = append(c.Args, arg)
	}
}

// decodeEnvelope returns a JSON payload as it is, but for a Kombu
// envelope (the celery target's), whose base64 body it shows decoded, as
// "body (decoded)" beside the message.
func decodeEnvelope(t *testing.T, arg string) any {
	t.Helper()
	var env struct {
		Body  string `json:"body"`
		Props struct {
			Encoding string `json:"body_encoding"`
		} `json:"properties"`
	}
	if json.Unmarshal([]byte(arg), &env) != nil || env.Props.Encoding != "base64" {
		return json.RawMessage(arg)
	}
	body, err := base64.StdEncoding.DecodeString(env.Body)
	if err != nil || !json.Valid(body) {
		t.Fatalf("Kombu envelope: body is not base64 of JSON: %v: %s", err, env.Body)
	}
	return map[string]json.RawMessage{"message": json.RawMessage(arg), "body (decoded)": body}
}

// decodeTaskMessage decodes asynq's TaskMessage (internal/proto/asynq.proto
// of hibiken/asynq v0.26.0) from its protobuf wire format, by field name.
func decodeTaskMessage(t *testing.T, b []byte) map[string]any {
	t.Helper()
	names := map[protowire.Number]string{1: "type", 2: "payload", 3: "id", 4: "queue", 5: "retry", 6: "retried",
		7: "error_msg", 8: "timeout", 9: "deadline", 10: "unique_key", 11: "last_failed_at", 12: "retention",
		13: "completed_at", 14: "group_key", 15: "headers"}
	out := make(map[string]any)
	headers := make(map[string]string)
	for len(b) > 0 {
		num, typ, n := protowire.ConsumeTag(b)
		if n < 0 {
			t.Fatalf("TaskMessage: bad tag: %v", protowire.ParseError(n))
		}
		b = b[n:]
		name := names[num]
		if name == "" {
			name = fmt.Sprintf("field_%d", num)
		}
		switch typ {
		case protowire.VarintType:
			v, n := protowire.ConsumeVarint(b)
			if n < 0 {
				t.Fatalf("TaskMessage %s: %v", name, protowire.ParseError(n))
			}
			out[name], b = int64(v), b[n:]
		case protowire.BytesType:
			v, n := protowire.ConsumeBytes(b)
			if n < 0 {
				t.Fatalf("TaskMessage %s: %v", name, protowire.ParseError(n))
			}
			b = b[n:]
			if num == 15 { // map<string, string> entry: key 1, value 2
				var k, val string
				for len(v) > 0 {
					f, _, m := protowire.ConsumeTag(v)
					s, m2 := protowire.ConsumeString(v[m:])
					if m < 0 || m2 < 0 {
						t.Fatalf("TaskMessage headers: bad entry")
					}
					if f == 1 {
						k = s
					} else {
						val = s
					}
					v = v[m+m2:]
				}
				headers[k] = val
				continue
			}
			if !utf8.Valid(v) {
				t.Fatalf("TaskMessage %s is not text", name)
			}
			out[name] = string(v)
		default:
			t.Fatalf("TaskMessage %s: wire type %d", name, typ)
		}
	}
	if len(headers) > 0 {
		out["headers"] = headers
	}
	return out
}

// checkGolden compares f, as indented JSON, with ../testdata/<name>, or
// writes it there under -update.
func checkGolden(t *testing.T, name string, f goldenFile) {
	t.Helper()
	var buf bytes.Buffer
	enc := json.NewEncoder(&buf)
	enc.SetEscapeHTML(false)
	enc.SetIndent("", "  ")
	if err := enc.Encode(f); err != nil {
		t.Fatal(err)
	}
	path := filepath.Join("..", "testdata", name)
	if *update {
		if err := os.WriteFile(path, buf.Bytes(), 0o644); err != nil {
			t.Fatal(err)
		}
		return
	}
	want, err := os.ReadFile(path)
	if err != nil {
		t.Fatalf("%v (go test ./relay -run Golden -update writes it)", err)
	}
	if bytes.Equal(buf.Bytes(), want) {
		return
	}
	got, exp := strings.Split(buf.String(), "\n"), strings.Split(string(want), "\n")
	n := 0
	for n < len(got) && n < len(exp) && got[n] == exp[n] {
		n++
	}
	line := func(ls []string) string {
		if n < len(ls) {
			return strings.TrimSpace(ls[n])
		}
		return "(end of file)"
	}
	t.Errorf("%s:%d: the target writes %s where the file has %s; if that is meant, rerun with -update and review git diff.\nwhole output:\n%s",
		path, n+1, line(got), line(exp), buf.Bytes())
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
	jid := goldenJID
	if id > 1 {
		jid = fmt.Sprintf("%s%02d", goldenJID[:22], id)
	}
	return stagedJob{id: id, name: name, args: []byte(args), queue: queue, runAt: runAt, jid: jid,
		createdAt: goldenCreated, options: []byte(options)}
}

func TestGoldenSidekiq(t *testing.T) {
	t.Parallel()
	earlier := goldenNow.Add(-time.Minute)
	immediate := []stagedJob{
		goldenJob(1, "WelcomeJob", `[42, "ada@example.com"]`, "default", nil, `{}`),
		goldenJob(2, "ReceiptJob", `[{"order": 7}]`, "default", &earlier, `{"retry": 5, "tags": ["billing"]}`),
		goldenJob(3, "AuditJob", `[]`, "low", nil, `{"retry": false}`),
	}
	scheduled := []stagedJob{
		goldenJob(1, "ReminderJob", `[42]`, "default", &goldenLater, `{}`),
		goldenJob(2, "ReportJob", `["weekly"]`, "reports", &goldenLater, `{"backtrace": 10}`),
	}
	for _, c := range []struct {
		file string
		what string
		jobs []stagedJob
		ts   TimestampFormat
	}{
		{"sidekiq_immediate_seconds.json", "Immediate jobs (run_at NULL or past), created_at and enqueued_at as float epoch seconds (Sidekiq 7 and older)", immediate, TimestampSeconds},
		{"sidekiq_immediate_millis.json", "Immediate jobs (run_at NULL or past), created_at and enqueued_at as integer epoch milliseconds (Sidekiq 8)", immediate, TimestampMillis},
		{"sidekiq_scheduled_seconds.json", "Scheduled jobs (run_at in the future): ZADD schedule, score run_at in float epoch seconds, no enqueued_at; created_at in float epoch seconds (Sidekiq 7 and older)", scheduled, TimestampSeconds},
		{"sidekiq_scheduled_millis.json", "Scheduled jobs (run_at in the future): ZADD schedule, score run_at in float epoch seconds (in both formats), no enqueued_at; created_at in integer epoch milliseconds (Sidekiq 8)", scheduled, TimestampMillis},
	} {
		checkGolden(t, c.file, goldenFile{Case: c.what, Target: "sidekiq", Timestamps: c.ts, Now: goldenNow,
			Rows: rowsOf(c.jobs), Ops: build(t, builtin(TargetSidekiq, targets.Options{MaxPayload: 1 << 20, Millis: c.ts == TimestampMillis}), c.jobs)})
	}
}

func TestGoldenAsynq(t *testing.T) {
	t.Parallel()
	plain := []stagedJob{goldenJob(1, "email:welcome", `[42, "ada@example.com"]`, "default", nil,
		`{"retry": 3, "timeout": 60, "headers": {"trace": "abc"}}`)}
	checkGolden(t, "asynq_task.json", goldenFile{
		Case:   "An immediate asynq task: HSET asynq:{queue}:t:<jid> msg (a protobuf TaskMessage; decoded beside it), state pending, pending_since (unix nanoseconds); LPUSH asynq:{queue}:pending <jid>; skipped if the task key exists",
		Target: "asynq", Now: goldenNow, Rows: rowsOf(plain), Ops: build(t, builtin(TargetAsynq, targets.Options{MaxPayload: 1 << 20}), plain)})
	sched := []stagedJob{goldenJob(1, "report:weekly", `["weekly"]`, "reports", &goldenLater, `{"unique": 600}`)}
	checkGolden(t, "asynq_task_scheduled_unique.json", goldenFile{
		Case:   "A scheduled asynq task with the unique option: the uniqueness lock (SET EX until run_at plus the TTL), HSET state scheduled, ZADD asynq:{queue}:scheduled <run_at epoch seconds>; skipped if the task key or the lock exists",
		Target: "asynq", Now: goldenNow, Rows: rowsOf(sched), Ops: build(t, builtin(TargetAsynq, targets.Options{MaxPayload: 1 << 20}), sched)})
}

func TestGoldenStreams(t *testing.T) {
	t.Parallel()
	jobs := []stagedJob{goldenJob(1, "WelcomeJob", `[42, "ada@example.com"]`, "default", nil, `{"retry": 5}`)}
	checkGolden(t, "streams_entry.json", goldenFile{
		Case:   "A Redis Streams entry: XADD stream:<queue> (MAXLEN ~ when set) * with the fields jid, class, args, queue, created_at (epoch milliseconds) and options (left out when {})",
		Target: "streams", Now: goldenNow, Rows: rowsOf(jobs), Ops: build(t, builtin(TargetStreams, targets.Options{MaxPayload: 1 << 20, StreamMaxLen: 100000}), jobs)})
}

func TestGoldenCelery(t *testing.T) {
	t.Parallel()
	fixed := func(n int) []string { // delivery tags: random UUIDs, fixed here
		out := make([]string, n)
		for i := range out {
			out[i] = fmt.Sprintf("00000000-0000-4000-8000-%012d", i+1)
		}
		return out
	}
	jobs := []stagedJob{
		goldenJob(1, "myapp.tasks.send_welcome", `[42, "ada@example.com"]`, "celery", nil, `{}`),
		goldenJob(2, "myapp.tasks.charge", `[42]`, "billing", nil,
			`{"kwargs": {"amount": 1999, "currency": "usd"}, "priority": 5, "expires": 600, "time_limit": 30, "soft_time_limit": 25, "retries": 1, "headers": {"request_id": "r-7"}, "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}`),
		goldenJob(3, "myapp.tasks.audit", `[]`, "celery", nil, `{"priority": 9, "ignore_result": true, "shadow": "audit"}`),
	}
	tg := builtin(TargetCelery, targets.Options{MaxPayload: 1 << 20, UUIDs: fixed})
	checkGolden(t, "celery_task.json", goldenFile{
		Case:   "Celery task messages (protocol 2 in Kombu's JSON envelope; body decoded beside each): LPUSH <queue> for priority 0-2 (the default 0), <queue>\\x06\\x163, 6 or 9 for higher numbers (Kombu's priority lists; on Redis a lower number runs first); options kwargs, expires (seconds after created_at), time limits, retries, custom headers and the trace context as headers",
		Target: "celery", Now: goldenNow, Rows: rowsOf(jobs), Ops: build(t, tg, jobs)})
	tenant := []stagedJob{goldenJob(1, "myapp.tasks.send_welcome", `[42]`, "celery", nil, `{"apartment": "tenant_acme"}`)}
	tg = builtin(TargetCelery, targets.Options{Namespace: "myapp", MaxPayload: 1 << 20, UUIDs: fixed, Tenant: newTenantTag("apartment", "tenant_acme")})
	checkGolden(t, "celery_task_namespace_tenant.json", goldenFile{
		Case:   "A Celery task with --redis-namespace myapp (the workers set Kombu's global_keyprefix to \"myapp:\") and --tenant-key apartment: the list is myapp:<queue>, the tenant a header (task.request.apartment)",
		Target: "celery", TenantKey: "apartment", Schema: "tenant_acme", Now: goldenNow, Rows: rowsOf(tenant), Ops: build(t, tg, tenant)})
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
		Target: "sidekiq", Timestamps: TimestampSeconds, Now: goldenNow, Source: article,
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
		Target: "sidekiq", Timestamps: TimestampSeconds, Now: goldenNow, Source: map[string]any{"sidekiq_staged_push_jobs": gem},
		Rows: rowsOf(jobs), Ops: build(t, builtin(TargetSidekiq, targets.Options{MaxPayload: 1 << 20}), jobs)})
}
