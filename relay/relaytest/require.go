package relaytest

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"math/big"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
)

// Querier is what the Require functions read staged_jobs through: pgx.Tx
// (the rows as that transaction sees them, its own uncommitted INSERTs
// included), *pgx.Conn or *pgxpool.Pool (committed rows only).
type Querier interface {
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
}

// Job describes a staged job to look for. Name is required (except by
// RequireNotStaged); every other field left at its zero value matches
// anything.
type Job struct {
	// Name is the worker class, job_name.
	Name string
	// Args are compared as JSON with job_args: []any{42} matches [42] and
	// [42.0], and the order of object keys does not matter. nil matches any
	// arguments; []any{} matches only [].
	Args []any
	// Queue is the queue, e.g. "default".
	Queue string
	// RunAt is the time the job was scheduled for (run_at), to the
	// microsecond PostgreSQL keeps. The zero value matches a job scheduled
	// or not.
	RunAt time.Time
	// Options are matched key by key, each value as JSON, against the
	// row's options: the row may hold more keys.
	Options map[string]any
	// JID is Sidekiq's job id, as Stage returned it.
	JID string
}

// StagedJob is a row of staged_jobs.
type StagedJob struct {
	ID        int64
	JID       string
	Name      string
	Args      json.RawMessage
	Queue     string
	RunAt     time.Time // zero when run_at is NULL
	CreatedAt time.Time
	Options   json.RawMessage
}

func (j StagedJob) String() string {
	s := fmt.Sprintf("id %d: %s args %s queue %s jid %s", j.ID, j.Name, j.Args, j.Queue, j.JID)
	if !j.RunAt.IsZero() {
		s += " run_at " + j.RunAt.UTC().Format(time.RFC3339Nano)
	}
	if string(j.Options) != "{}" {
		s += " options " + string(j.Options)
	}
	return s
}

// Option changes where the Require functions look.
type Option func(*options)

type options struct {
	schema string
}

// WithSchema reads schema.staged_jobs instead of public.staged_jobs.
func WithSchema(schema string) Option {
	return func(o *options) { o.schema = schema }
}

func buildOptions(opts []Option) options {
	o := options{schema: "public"}
	for _, f := range opts {
		f(&o)
	}
	return o
}

// RequireStaged fails the test unless exactly one row of staged_jobs, as q
// sees it, matches want, and returns that row. To check several jobs, use
// RequireStagedMany.
func RequireStaged(t testing.TB, q Querier, want Job, opts ...Option) StagedJob {
	t.Helper()
	o := buildOptions(opts)
	if want.Name == "" {
		t.Fatalf("relaytest: RequireStaged: Job.Name is empty")
	}
	rows := readStaged(t, q, o.schema)
	var matched []StagedJob
	for _, r := range rows {
		if matches(t, want, r) {
			matched = append(matched, r)
		}
	}
	if len(matched) != 1 {
		hint := ""
		if len(matched) > 1 {
			hint = " (narrow the match, or use RequireStagedMany)"
		}
		t.Fatalf("relaytest: want 1 staged job matching %s in %s, found %d%s; %s",
			describe(want), table(o.schema), len(matched), hint, listRows(rows))
	}
	return matched[0]
}

// RequireStagedMany fails the test unless the rows of staged_jobs, as q sees
// them, are exactly as many as want and, in the order they were staged (by
// id), each matches the Job of want at its index. It returns the rows.
func RequireStagedMany(t testing.TB, q Querier, want []Job, opts ...Option) []StagedJob {
	t.Helper()
	o := buildOptions(opts)
	for i, w := range want {
		if w.Name == "" {
			t.Fatalf("relaytest: RequireStagedMany: want[%d].Name is empty", i)
		}
	}
	rows := readStaged(t, q, o.schema)
	var problems []string
	if len(rows) != len(want) {
		problems = append(problems, fmt.Sprintf("want %d staged jobs, found %d", len(want), len(rows)))
	}
	for i := range min(len(rows), len(want)) {
		if !matches(t, want[i], rows[i]) {
			problems = append(problems, fmt.Sprintf("job %d: want %s, found %s", i, describe(want[i]), rows[i]))
		}
	}
	if len(problems) > 0 {
		var w []string
		for _, j := range want {
			w = append(w, describe(j))
		}
		t.Fatalf("relaytest: staged jobs in %s differ: %s; want, in order: %s; %s",
			table(o.schema), strings.Join(problems, "; "), strings.Join(w, ", "), listRows(rows))
	}
	return rows
}

// RequireNotStaged fails the test if a row of staged_jobs, as q sees it,
// matches want. A Job with every field zero matches any row: the test then
// fails if anything is staged at all.
func RequireNotStaged(t testing.TB, q Querier, want Job, opts ...Option) {
	t.Helper()
	o := buildOptions(opts)
	rows := readStaged(t, q, o.schema)
	var matched []string
	for _, r := range rows {
		if matches(t, want, r) {
			matched = append(matched, r.String())
		}
	}
	if len(matched) > 0 {
		t.Fatalf("relaytest: want no staged job matching %s in %s, found %d: %s",
			describe(want), table(o.schema), len(matched), strings.Join(matched, "; "))
	}
}

func table(schema string) string { return pgx.Identifier{schema, "staged_jobs"}.Sanitize() }

// readStaged returns every row of schema.staged_jobs that q sees, by id.
func readStaged(t testing.TB, q Querier, schema string) []StagedJob {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	// Look before reading: a failed statement would abort the caller's
	// transaction.
	rows, err := q.Query(ctx, `SELECT to_regclass($1) IS NOT NULL`, table(schema))
	if err != nil {
		t.Fatalf("relaytest: look up %s: %v", table(schema), err)
	}
	exists, err := pgx.CollectExactlyOneRow(rows, pgx.RowTo[bool])
	if err != nil {
		t.Fatalf("relaytest: look up %s: %v", table(schema), err)
	}
	if !exists {
		t.Fatalf("relaytest: there is no table %s: migrate the schema (relay.Migrate), or name yours with WithSchema", table(schema))
	}
	rows, err = q.Query(ctx, `SELECT id, jid, job_name, job_args::text, queue, run_at, created_at, options::text
		FROM `+table(schema)+` ORDER BY id`)
	if err != nil {
		t.Fatalf("relaytest: read %s: %v", table(schema), err)
	}
	jobs, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (StagedJob, error) {
		var j StagedJob
		var args, opts string
		var runAt *time.Time
		err := r.Scan(&j.ID, &j.JID, &j.Name, &args, &j.Queue, &runAt, &j.CreatedAt, &opts)
		j.Args, j.Options = json.RawMessage(args), json.RawMessage(opts)
		if runAt != nil {
			j.RunAt = *runAt
		}
		return j, err
	})
	if err != nil {
		t.Fatalf("relaytest: read %s: %v", table(schema), err)
	}
	return jobs
}

// matches reports whether row r has every field want sets.
func matches(t testing.TB, want Job, r StagedJob) bool {
	t.Helper()
	if want.Name != "" && want.Name != r.Name ||
		want.Queue != "" && want.Queue != r.Queue ||
		want.JID != "" && want.JID != r.JID {
		return false
	}
	if !want.RunAt.IsZero() {
		if d := r.RunAt.Sub(want.RunAt); r.RunAt.IsZero() || d <= -time.Microsecond || d >= time.Microsecond {
			return false
		}
	}
	if want.Args != nil && !jsonEqual(mustMarshal(t, "Args", want.Args), r.Args) {
		return false
	}
	if len(want.Options) > 0 {
		var got map[string]json.RawMessage
		if err := json.Unmarshal(r.Options, &got); err != nil {
			return false
		}
		for k, v := range want.Options {
			g, ok := got[k]
			if !ok || !jsonEqual(mustMarshal(t, "Options["+k+"]", v), g) {
				return false
			}
		}
	}
	return true
}

func mustMarshal(t testing.TB, field string, v any) []byte {
	t.Helper()
	b, err := json.Marshal(v)
	if err != nil {
		t.Fatalf("relaytest: marshal Job.%s: %v", field, err)
	}
	return b
}

// describe writes the fields want sets.
func describe(want Job) string {
	var parts []string
	if want.Name != "" {
		parts = append(parts, fmt.Sprintf("Name %q", want.Name))
	}
	if want.Args != nil {
		b, err := json.Marshal(want.Args)
		if err != nil {
			b = []byte(fmt.Sprint(want.Args))
		}
		parts = append(parts, "Args "+string(b))
	}
	if want.Queue != "" {
		parts = append(parts, fmt.Sprintf("Queue %q", want.Queue))
	}
	if !want.RunAt.IsZero() {
		parts = append(parts, "RunAt "+want.RunAt.UTC().Format(time.RFC3339Nano))
	}
	if len(want.Options) > 0 {
		b, err := json.Marshal(want.Options)
		if err != nil {
			b = []byte(fmt.Sprint(want.Options))
		}
		parts = append(parts, "Options "+string(b)+" (among others)")
	}
	if want.JID != "" {
		parts = append(parts, fmt.Sprintf("JID %q", want.JID))
	}
	if len(parts) == 0 {
		return "{any job}"
	}
	return "{" + strings.Join(parts, ", ") + "}"
}

// maxListed bounds the rows a failure message lists.
const maxListed = 20

func listRows(rows []StagedJob) string {
	if len(rows) == 0 {
		return "nothing is staged"
	}
	var b strings.Builder
	fmt.Fprintf(&b, "staged (%d):", len(rows))
	for i, r := range rows {
		if i == maxListed {
			fmt.Fprintf(&b, " ... and %d more", len(rows)-maxListed)
			break
		}
		fmt.Fprintf(&b, " [%s]", r)
	}
	return b.String()
}

// jsonEqual reports whether a and b are the same JSON value: object key
// order does not matter, and numbers are equal when their values are
// (42, 42.0 and 4.2e1 are one number).
func jsonEqual(a, b []byte) bool {
	va, ok := decodeJSON(a)
	if !ok {
		return false
	}
	vb, ok := decodeJSON(b)
	if !ok {
		return false
	}
	return equalValues(va, vb)
}

func decodeJSON(b []byte) (any, bool) {
	d := json.NewDecoder(bytes.NewReader(b))
	d.UseNumber()
	var v any
	if err := d.Decode(&v); err != nil {
		return nil, false
	}
	return v, true
}

func equalValues(a, b any) bool {
	switch a := a.(type) {
	case json.Number:
		b, ok := b.(json.Number)
		if !ok {
			return false
		}
		ra, okA := new(big.Rat).SetString(a.String())
		rb, okB := new(big.Rat).SetString(b.String())
		return okA && okB && ra.Cmp(rb) == 0
	case []any:
		b, ok := b.([]any)
		if !ok || len(a) != len(b) {
			return false
		}
		for i := range a {
			if !equalValues(a[i], b[i]) {
				return false
			}
		}
		return true
	case map[string]any:
		b, ok := b.(map[string]any)
		if !ok || len(a) != len(b) {
			return false
		}
		for k, v := range a {
			w, ok := b[k]
			if !ok || !equalValues(v, w) {
				return false
			}
		}
		return true
	default: // string, bool, nil
		return reflect.DeepEqual(a, b)
	}
}
