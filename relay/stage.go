package relay

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/jackc/pgx/v5"

	targets "github.com/stagedrain/stagedrain/relay/internal/target"
)

// Job is a job to stage.
type Job struct {
	// Name is the worker class, Sidekiq's "class". Required.
	Name string
	// Args are the job's arguments, marshaled with encoding/json into a
	// JSON array. nil means no arguments.
	Args []any
	// Queue is the queue to push to. "" means "default".
	Queue string
	// RunAt schedules the job. The zero value means run as soon as the
	// transaction commits.
	RunAt time.Time
	// Options are extra payload fields (retry, tags, backtrace, ...),
	// marshaled with encoding/json. The keys class, args, queue, jid,
	// created_at, enqueued_at and at are rejected: they come from columns.
	Options map[string]any
}

// Querier is what Stage needs of a pgx transaction: pgx.Tx has it, and so do
// *pgx.Conn and *pgxpool.Pool, though then the job is not tied to the
// caller's other writes.
type Querier interface {
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
}

// Stager INSERTs jobs into one schema's staged_jobs. It is safe for
// concurrent use.
type Stager struct {
	insertOne  string
	insertMany string
}

// NewStager returns a Stager for schema ("" means "public").
func NewStager(schema string) *Stager {
	if schema == "" {
		schema = defaultSchema
	}
	table := pgx.Identifier{schema, "staged_jobs"}.Sanitize()
	return &Stager{
		insertOne: `INSERT INTO ` + table + ` (job_name, job_args, queue, run_at, options)
			VALUES ($1, $2, $3, $4, $5) RETURNING jid`,
		// ORDER BY ord makes the sequence hand out ids in input order, so
		// sorting the returned rows by id matches them to the input.
		insertMany: `INSERT INTO ` + table + ` (job_name, job_args, queue, run_at, options)
			SELECT n, a, q, r, o
			FROM unnest($1::text[], $2::jsonb[], $3::text[], $4::timestamptz[], $5::jsonb[])
				WITH ORDINALITY AS j(n, a, q, r, o, ord)
			ORDER BY ord
			RETURNING id, jid`,
	}
}

// Stage INSERTs job through tx and returns its jid. The job reaches Redis
// only if tx commits. When ctx holds a span, its W3C trace context, as the
// configured propagator (otel.GetTextMapPropagator) writes it, goes into
// the job's options as "traceparent" (and "tracestate"), unless Options set
// a traceparent of their own; the relay hands it to the worker (trace.go).
func (s *Stager) Stage(ctx context.Context, tx Querier, job Job) (string, error) {
	row, err := encodeJob(job)
	if err != nil {
		return "", err
	}
	row.options = withTraceContext(ctx, row.options, job.Options)
	var jid string
	if err := tx.QueryRow(ctx, s.insertOne, row.name, row.args, row.queue, row.runAt, row.options).Scan(&jid); err != nil {
		return "", fmt.Errorf("stage %s: %w", job.Name, err)
	}
	return jid, nil
}

// StageMany INSERTs jobs through tx in one round trip and returns their
// jids in the order of jobs.
func (s *Stager) StageMany(ctx context.Context, tx Querier, jobs []Job) ([]string, error) {
	if len(jobs) == 0 {
		return nil, nil
	}
	names := make([]string, len(jobs))
	args := make([]string, len(jobs))
	queues := make([]string, len(jobs))
	runAts := make([]*time.Time, len(jobs))
	options := make([]string, len(jobs))
	for i, job := range jobs {
		row, err := encodeJob(job)
		if err != nil {
			return nil, fmt.Errorf("job %d: %w", i, err)
		}
		row.options = withTraceContext(ctx, row.options, job.Options)
		names[i], args[i], queues[i], runAts[i], options[i] = row.name, row.args, row.queue, row.runAt, row.options
	}
	rows, err := tx.Query(ctx, s.insertMany, names, args, queues, runAts, options)
	if err != nil {
		return nil, fmt.Errorf("stage %d jobs: %w", len(jobs), err)
	}
	type idJID struct {
		id  int64
		jid string
	}
	got, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (idJID, error) {
		var v idJID
		err := r.Scan(&v.id, &v.jid)
		return v, err
	})
	if err != nil {
		return nil, fmt.Errorf("stage %d jobs: %w", len(jobs), err)
	}
	if len(got) != len(jobs) {
		return nil, fmt.Errorf("stage %d jobs: %d rows inserted", len(jobs), len(got))
	}
	// Ids from one sequence in one statement rise in insert order.
	slices.SortFunc(got, func(a, b idJID) int { return cmp.Compare(a.id, b.id) })
	jids := make([]string, len(got))
	for i, v := range got {
		jids[i] = v.jid
	}
	return jids, nil
}

type jobRow struct {
	name, args, queue, options string
	runAt                      *time.Time
}

func encodeJob(job Job) (jobRow, error) {
	if job.Name == "" {
		return jobRow{}, errors.New("job Name is empty")
	}
	row := jobRow{name: job.Name, queue: job.Queue, args: "[]", options: "{}"}
	if row.queue == "" {
		row.queue = "default"
	}
	if job.Args != nil {
		b, err := json.Marshal(job.Args)
		if err != nil {
			return jobRow{}, fmt.Errorf("job %s: marshal args: %w", job.Name, err)
		}
		row.args = string(b)
	}
	if len(job.Options) > 0 {
		for _, k := range targets.ReservedKeys {
			if _, ok := job.Options[k]; ok {
				return jobRow{}, fmt.Errorf("job %s: option %q is set by a column", job.Name, k)
			}
		}
		b, err := json.Marshal(job.Options)
		if err != nil {
			return jobRow{}, fmt.Errorf("job %s: marshal options: %w", job.Name, err)
		}
		row.options = string(b)
	}
	if !job.RunAt.IsZero() {
		t := job.RunAt
		row.runAt = &t
	}
	return row, nil
}
