package relay

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
)

// stagedJob is one claimed row of staged_jobs.
type stagedJob struct {
	id        int64
	name      string
	args      []byte // JSON text of a JSONB array
	queue     string
	runAt     *time.Time
	jid       string
	createdAt time.Time
	options   []byte // JSON text of a JSONB object
}

// tableSQL holds the statements of one schema's staged_jobs, with every
// identifier quoted once, here.
type tableSQL struct {
	claim   string
	delete  string
	version string
}

func newTableSQL(schema string) tableSQL {
	table := pgx.Identifier{schema, "staged_jobs"}.Sanitize()
	migrations := pgx.Identifier{schema, "stagedrain_migrations"}.Sanitize()
	return tableSQL{
		// Committed rows only (READ COMMITTED sees nothing uncommitted), oldest
		// id first. FOR UPDATE SKIP LOCKED keeps the rows locked while they
		// are pushed, so even two relays that both think they lead never
		// claim the same row.
		claim: `SELECT id, job_name, job_args, queue, run_at, jid, created_at, options FROM ` + table +
			` ORDER BY id LIMIT $1 FOR UPDATE SKIP LOCKED`,
		// Exactly the pushed ids: never "id <= max", which under READ
		// COMMITTED would delete a lower id committed after the claim.
		delete: `DELETE FROM ` + table + ` WHERE id = ANY($1)`,
		// The schema version Migrate recorded; NULL when it recorded none,
		// and an undefined_table error when it never ran.
		version: `SELECT max(version) FROM ` + migrations,
	}
}

// claimBatch reads up to limit committed rows into dst[:0] and locks them
// for the rest of tx.
func claimBatch(ctx context.Context, tx pgx.Tx, sql string, limit int, dst []stagedJob) ([]stagedJob, error) {
	rows, err := tx.Query(ctx, sql, limit)
	if err != nil {
		return dst, fmt.Errorf("claim batch: %w", err)
	}
	defer rows.Close()
	dst = dst[:0]
	for rows.Next() {
		dst = append(dst, stagedJob{})
		j := &dst[len(dst)-1]
		if err := rows.Scan(&j.id, &j.name, &j.args, &j.queue, &j.runAt, &j.jid, &j.createdAt, &j.options); err != nil {
			return dst, fmt.Errorf("claim batch: scan row: %w", err)
		}
	}
	if err := rows.Err(); err != nil {
		return dst, fmt.Errorf("claim batch: %w", err)
	}
	return dst, nil
}
