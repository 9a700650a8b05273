package relay_test

import (
	"context"
	"encoding/json"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/stagedrain/stagedrain/relay"
)

// Stage and StageMany write what they are given and return the jids the
// rows got, in input order.
func TestStagerWritesRowsAndReturnsJIDs(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	ctx := context.Background()
	at := time.Now().Add(time.Hour).Truncate(time.Microsecond)
	jobs := []relay.Job{
		{Name: "First", Args: []any{1, "a"}},
		{Name: "Second", Queue: "mail", RunAt: at, Options: map[string]any{"retry": 2}},
		{Name: "Third", Args: []any{map[string]any{"k": []int{1, 2}}}},
	}
	var one string
	var many []string
	err := pgx.BeginFunc(ctx, h.conn, func(tx pgx.Tx) error {
		var err error
		if one, err = h.stager.Stage(ctx, tx, relay.Job{Name: "Solo"}); err != nil {
			return err
		}
		many, err = h.stager.StageMany(ctx, tx, jobs)
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	if len(many) != len(jobs) {
		t.Fatalf("StageMany returned %d jids, want %d", len(many), len(jobs))
	}

	type row struct {
		name, queue   string
		args, options []byte
		runAt         *time.Time
	}
	read := func(jid string) row {
		var r row
		err := h.conn.QueryRow(ctx, `SELECT job_name, queue, job_args, options, run_at FROM `+
			pgx.Identifier{h.schema, "staged_jobs"}.Sanitize()+` WHERE jid = $1`, jid).
			Scan(&r.name, &r.queue, &r.args, &r.options, &r.runAt)
		if err != nil {
			t.Fatalf("read row of jid %s: %v", jid, err)
		}
		return r
	}
	if r := read(one); r.name != "Solo" || r.queue != "default" || string(r.args) != "[]" || string(r.options) != "{}" || r.runAt != nil {
		t.Fatalf("Stage wrote %+v (args %s, options %s), want Solo on default with [] and {}", r, r.args, r.options)
	}
	for i, jid := range many {
		r := read(jid)
		wantArgs, _ := json.Marshal(jobs[i].Args)
		if jobs[i].Args == nil {
			wantArgs = []byte("[]")
		}
		if r.name != jobs[i].Name || !jsonEqual(t, r.args, wantArgs) {
			t.Fatalf("jid %d (%s) holds %s%s, want %s%s", i, jid, r.name, r.args, jobs[i].Name, wantArgs)
		}
	}
	second := read(many[1])
	if second.queue != "mail" || second.runAt == nil || !second.runAt.Equal(at) || !jsonEqual(t, second.options, []byte(`{"retry":2}`)) {
		t.Fatalf("second job = queue %s run_at %v options %s, want mail, %v, {\"retry\":2}", second.queue, second.runAt, second.options, at)
	}
}

func TestStagerRejectsBadJobs(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	ctx := context.Background()
	for _, job := range []relay.Job{
		{},
		{Name: "J", Options: map[string]any{"queue": "x"}},
		{Name: "J", Args: []any{make(chan int)}},
	} {
		if _, err := h.stager.Stage(ctx, h.conn, job); err == nil {
			t.Errorf("Stage(%+v) succeeded, want an error", job)
		}
		if _, err := h.stager.StageMany(ctx, h.conn, []relay.Job{{Name: "Fine"}, job}); err == nil {
			t.Errorf("StageMany with %+v succeeded, want an error", job)
		}
	}
	if n := h.staged(); n != 0 {
		t.Fatalf("%d rows staged after rejected jobs, want 0", n)
	}
}

func jsonEqual(t *testing.T, a, b []byte) bool {
	t.Helper()
	var x, y any
	if err := json.Unmarshal(a, &x); err != nil {
		t.Fatalf("not JSON: %s", a)
	}
	if err := json.Unmarshal(b, &y); err != nil {
		t.Fatalf("not JSON: %s", b)
	}
	xb, _ := json.Marshal(x)
	yb, _ := json.Marshal(y)
	return string(xb) == string(yb)
}
