package target_test

import (
	"bytes"
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/stagedrain/stagedrain/relay"
	"github.com/stagedrain/stagedrain/relay/internal/handoff"
	"github.com/stagedrain/stagedrain/relay/internal/target"
	"github.com/stagedrain/stagedrain/relay/internal/testenv"
)

// update makes the golden tests rewrite their files instead of comparing:
// go test ./... -update (every test package of the module defines it).
var update = flag.Bool("update", false, "rewrite the golden files")

// Every target's golden files exist, and the targets are listed in their
// Order, the built-in ones first, as Config.Validate's error names them.
func TestSpecs(t *testing.T) {
	names := target.Names()
	if want := []string{"sidekiq", "asynq", "streams", "bullmq", "celery", "lists"}; !slices.Equal(names, want) {
		t.Fatalf("targets %v, want %v", names, want)
	}
	if got := target.OneOf(); !strings.HasPrefix(got, `"sidekiq", "asynq", "streams", "bullmq", "celery" or "lists"`) {
		t.Fatalf("OneOf = %s", got)
	}
	for _, name := range names {
		s, _ := target.Lookup(name)
		if s.Length == "" || s.TraceSystem == "" || len(s.Goldens) == 0 {
			t.Errorf("%s: Length %q, TraceSystem %q, Goldens %v: each must be declared", name, s.Length, s.TraceSystem, s.Goldens)
		}
		for _, g := range s.Goldens {
			path := filepath.Join("..", "..", "..", "testdata", g)
			if strings.Contains(g, "/") {
				path = filepath.Join("..", "..", "..", g)
			}
			if _, err := os.Stat(path); err != nil {
				t.Errorf("%s: golden file %s: %v", name, g, err)
			}
		}
	}
}

var (
	created = time.Date(2026, 11, 29, 12, 0, 0, 500_000_000, time.UTC)
	jobs    = []target.Job{
		{ID: 1, Name: "Welcome", Args: []byte(`[42,"ada"]`), Queue: "default", JID: "jid-1", CreatedAt: created, Options: []byte(`{}`)},
		{ID: 2, Name: "Report", Args: []byte(`[]`), Queue: "low", JID: "jid-2", CreatedAt: created, Options: []byte(`{}`)},
	}
)

// The lists target, registered from a test file alone, is pushed through
// the real handoff (the fence, the record, the push script) into a real
// Redis and read back; what it builds is its golden file.
func TestListsTargetThroughTheHandoff(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	rdb, ns := testenv.Redis(t)
	spec, ok := target.Lookup("lists")
	if !ok || spec.New == nil {
		t.Fatal("the lists target is not registered")
	}
	b := spec.New(target.Options{Namespace: ns, MaxPayload: 1 << 20})
	h := handoff.New(rdb, handoff.Keys{Fence: ns + ":stagedrain:test:lists:fence", Record: ns + ":stagedrain:test:lists:handoff"})
	if err := h.Ready(ctx, "test"); err != nil {
		t.Fatal(err)
	}
	u := h.Unit()
	u.Reset()
	var res target.Result
	b.Add(u, jobs, created, &res)
	if len(res.Rejected) != 0 || !slices.Equal(res.Queues, []string{"default", "low"}) {
		t.Fatalf("rejected %v, queues %v; want none rejected, queues default and low", res.Rejected, res.Queues)
	}
	listsGolden(t, "lists.json", u)
	if _, err := h.Push(ctx, u); err != nil {
		t.Fatal(err)
	}
	for _, op := range u.Ops() {
		if op.Err != nil || op.Skipped {
			t.Fatalf("op %v: %v, skipped %v; want delivered", op.IDs, op.Err, op.Skipped)
		}
	}
	for _, j := range jobs {
		got, err := rdb.LRange(ctx, ns+":lists:"+j.Queue, 0, -1).Result()
		if err != nil || len(got) != 1 {
			t.Fatalf("list of %s: %v, %v; want the job", j.Queue, got, err)
		}
		var back struct{ JID, Class string }
		if err := json.Unmarshal([]byte(got[0]), &back); err != nil || back.JID != j.JID || back.Class != j.Name {
			t.Fatalf("list of %s holds %s, want job %s", j.Queue, got[0], j.JID)
		}
	}
}

// listsGolden compares the commands u holds with testdata/<name>, or rewrites
// it with -update.
func listsGolden(t *testing.T, name string, u *handoff.Unit) {
	t.Helper()
	type cmd struct {
		Command string   `json:"command"`
		Keys    []string `json:"keys"`
		Args    []string `json:"args"`
	}
	type op struct {
		Rows     []int64 `json:"rows"`
		Commands []cmd   `json:"commands"`
	}
	var ops []op
	for i, o := range u.Ops() {
		_, cmds := u.Commands(i)
		g := op{Rows: o.IDs}
		for _, c := range cmds {
			var keys []string
			for _, k := range c.Keys {
				keys = append(keys, "NS"+k[strings.IndexByte(k, ':'):]) // the test's namespace varies
			}
			gc := cmd{Command: c.Name, Keys: keys}
			for _, a := range c.Args {
				switch v := a.(type) {
				case []byte:
					gc.Args = append(gc.Args, string(v))
				case string:
					gc.Args = append(gc.Args, v)
				default:
					t.Fatalf("argument %v of type %T", a, a)
				}
			}
			g.Commands = append(g.Commands, gc)
		}
		ops = append(ops, g)
	}
	got, err := json.MarshalIndent(ops, "", "  ")
	if err != nil {
		t.Fatal(err)
	}
	got = append(got, '\n')
	path := filepath.Join("testdata", name)
	if *update {
		if err := os.WriteFile(path, got, 0o644); err != nil {
			t.Fatal(err)
		}
		return
	}
	want, err := os.ReadFile(path)
	if err != nil {
		t.Fatalf("%v (go test -update writes it)", err)
	}
	if !bytes.Equal(got, want) {
		t.Fatalf("%s differs:\ngot:\n%s\nwant:\n%s", path, got, want)
	}
}

// The lists target runs in a real relay, from staged_jobs to Redis, chosen
// by Config.Target alone: nothing of the relay names it.
func TestListsTargetThroughTheRelay(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	rdb, ns := testenv.Redis(t)
	schema := testenv.Schema(t)
	conn := testenv.Conn(t, testenv.DatabaseURL())
	if _, err := relay.Migrate(ctx, conn, schema); err != nil {
		t.Fatal(err)
	}
	table := pgx.Identifier{schema, "staged_jobs"}.Sanitize()
	if _, err := conn.Exec(ctx, `INSERT INTO `+table+` (job_name, job_args, queue) VALUES
		('Welcome', '[42, "ada"]', 'default'), ('Report', '[]', 'low'), ('Welcome', '[7]', 'default')`); err != nil {
		t.Fatal(err)
	}
	r, err := relay.New(relay.Config{DatabaseURL: testenv.DatabaseURL(), Redis: rdb, Schema: schema,
		RedisNamespace: ns, Target: "lists", MaxBackoff: 500 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	runCtx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- r.Run(runCtx) }()
	defer func() {
		stop()
		if err := <-done; err != nil {
			t.Errorf("Run: %v", err)
		}
	}()
	llen := func(q string) int64 { return rdb.LLen(ctx, ns+":lists:"+q).Val() }
	testenv.WaitFor(t, 30*time.Second, "the relay to push the 3 jobs to their lists", func() (bool, string) {
		var left int
		_ = conn.QueryRow(ctx, `SELECT count(*) FROM `+table).Scan(&left)
		return llen("default") == 2 && llen("low") == 1 && left == 0,
			fmt.Sprintf("default %d, low %d, staged %d", llen("default"), llen("low"), left)
	})
	got := rdb.LRange(ctx, ns+":lists:default", 0, -1).Val()
	var first struct {
		Class string          `json:"class"`
		Args  json.RawMessage `json:"args"`
	}
	if err := json.Unmarshal([]byte(got[0]), &first); err != nil || first.Class != "Welcome" || string(first.Args) != `[42,"ada"]` {
		t.Fatalf("first job %s, want Welcome [42,\"ada\"]", got[0])
	}
}
