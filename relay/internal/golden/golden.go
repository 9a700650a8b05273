// Package golden is the harness of the golden tests, shared by relay's and
// relay/internal/target's: the files in testdata/ at the top of the module
// show, for fixed rows at a fixed time, each Redis command a target builds
// into a handoff.Unit, with what its arguments hold decoded beside them.
package golden

import (
	"bytes"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"
	"unicode/utf8"

	"google.golang.org/protobuf/encoding/protowire"

	"github.com/stagedrain/stagedrain/relay/internal/handoff"
	"github.com/stagedrain/stagedrain/relay/internal/target"
)

// The golden files, ../testdata/*.json, are what each target writes for
// fixed rows at a fixed time: for each op of the push (the rows it
// delivers, and the keys whose existence skips it), each Redis command with
// its key and arguments exactly as Redis receives them, and beside them
// what those arguments hold, decoded: a Sidekiq payload as JSON, an asynq
// TaskMessage's protobuf fields by name. The relay's own bookkeeping in the
// same script (the handoff record, handoff.go) is not shown.

// The fixed times and jid of the golden rows.
var (
	Created = time.Date(2026, 11, 29, 12, 0, 0, 500_000_000, time.UTC)
	Now     = Created.Add(2 * time.Second)
	Later   = time.Date(2026, 11, 29, 13, 30, 0, 250_000_000, time.UTC)
)

const JID = "0123456789abcdef01234567"

type File struct {
	Case       string `json:"case"`
	Target     string `json:"target"`
	Timestamps string `json:"timestamps,omitempty"`
	// TenantKey and Schema: with Config.TenantKey, the key and the schema
	// the rows were staged in (tenant.go).
	TenantKey string    `json:"tenant_key,omitempty"`
	Schema    string    `json:"schema,omitempty"`
	Now       time.Time `json:"now"`
	// Source is how the rows were staged, where they are not staged_jobs'
	// own: the article's table and INSERTs, or the gem's rows.
	Source any   `json:"source,omitempty"`
	Rows   []Row `json:"rows"`
	Ops    []Op  `json:"ops"`
}

// Row is a row of staged_jobs as the relay reads it.
type Row struct {
	ID        int64           `json:"id"`
	JobName   string          `json:"job_name"`
	JobArgs   json.RawMessage `json:"job_args"`
	Queue     string          `json:"queue"`
	RunAt     *time.Time      `json:"run_at"`
	JID       string          `json:"jid"`
	CreatedAt time.Time       `json:"created_at"`
	Options   json.RawMessage `json:"options"`
}

type Op struct {
	// Rows are the ids of the rows the op delivers; none for bookkeeping
	// (a queue set), whose failure matters to no row.
	Rows         []int64   `json:"rows"`
	SkipIfExists []string  `json:"skip_if_exists,omitempty"`
	Commands     []Command `json:"commands"`
}

type Command struct {
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

func Rows(jobs []target.Job) []Row {
	var out []Row
	for _, j := range jobs {
		var runAt *time.Time
		if j.RunAt != nil {
			t := j.RunAt.UTC()
			runAt = &t
		}
		out = append(out, Row{ID: j.ID, JobName: j.Name, JobArgs: j.Args, Queue: j.Queue, RunAt: runAt,
			JID: j.JID, CreatedAt: j.CreatedAt.UTC(), Options: j.Options})
	}
	return out
}

// Ops reads the commands a target built into u back out of the script's
// KEYS and ARGV layout, as the handoff reads it (handoff.Unit.Commands).
func Ops(t *testing.T, u *handoff.Unit) []Op {
	t.Helper()
	var out []Op
	for i, op := range u.Ops() {
		guards, cmds := u.Commands(i)
		g := Op{Rows: append([]int64{}, op.IDs...), SkipIfExists: guards}
		for _, cmd := range cmds {
			c := Command{Command: cmd.Name, Key: cmd.Keys[0]}
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
func decode(t *testing.T, c *Command, wire []string) {
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

// Check compares f, as indented JSON, with the file testdata/<name> at the
// top of the module (dir is the way there from the test's package), or
// writes it there when update is set (-update).
func Check(t *testing.T, dir, name string, f File, update bool) {
	t.Helper()
	var buf bytes.Buffer
	enc := json.NewEncoder(&buf)
	enc.SetEscapeHTML(false)
	enc.SetIndent("", "  ")
	if err := enc.Encode(f); err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(dir, "testdata", name)
	if update {
		if err := os.WriteFile(path, buf.Bytes(), 0o644); err != nil {
			t.Fatal(err)
		}
		return
	}
	want, err := os.ReadFile(path)
	if err != nil {
		t.Fatalf("%v (go test ./... -run Golden -update writes it)", err)
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

// Job is a golden row: the jid fixed (JID for id 1, its last two digits
// the id for the others), created at Created.
func Job(id int64, name, args, queue string, runAt *time.Time, options string) target.Job {
	jid := JID
	if id > 1 {
		jid = fmt.Sprintf("%s%02d", JID[:22], id)
	}
	return target.Job{ID: id, Name: name, Args: []byte(args), Queue: queue, RunAt: runAt, JID: jid,
		CreatedAt: Created, Options: []byte(options)}
}
