package relay

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgtype"

	"github.com/stagedrain/stagedrain/relay/internal/testenv"
)

// claimBatch's scan reads every run_at and created_at PostgreSQL can hold:
// a finite or NULL run_at as is; an infinite run_at or created_at makes
// the row poison, with a reason naming the column and the value, and is
// kept to be written back as it was (timestamptz), instead of failing the
// claim, and so every drain, for good.
func TestScanInfiniteTimes(t *testing.T) {
	t.Parallel()
	conn := testenv.Conn(t, testenv.DatabaseURL())
	ctx := context.Background()
	finite := time.Date(2026, 11, 30, 6, 0, 0, 123456000, time.UTC)
	const created = "'2026-11-30 05:00:00+00'"
	tests := []struct {
		name               string
		runAt, createdAt   string // SQL literals
		wantRunAt          *time.Time
		wantRunInf, wantCr pgtype.InfinityModifier
		wantBad            string
	}{
		{"finite", "'2026-11-30 06:00:00.123456+00'", created, &finite, pgtype.Finite, pgtype.Finite, ""},
		{"NULL run_at", "NULL", created, nil, pgtype.Finite, pgtype.Finite, ""},
		{"run_at infinity", "'infinity'", created, nil, pgtype.Infinity, pgtype.Finite,
			"run_at is infinity: Go and the job systems cannot hold it"},
		{"run_at -infinity", "'-infinity'", created, nil, pgtype.NegativeInfinity, pgtype.Finite,
			"run_at is -infinity: Go and the job systems cannot hold it"},
		{"created_at infinity", "NULL", "'infinity'", nil, pgtype.Finite, pgtype.Infinity,
			"created_at is infinity: Go and the job systems cannot hold it"},
		{"created_at -infinity", "'2026-11-30 06:00:00.123456+00'", "'-infinity'", &finite, pgtype.Finite, pgtype.NegativeInfinity,
			"created_at is -infinity: Go and the job systems cannot hold it"},
		{"both infinite", "'infinity'", "'-infinity'", nil, pgtype.Infinity, pgtype.NegativeInfinity,
			"run_at is infinity: Go and the job systems cannot hold it"},
	}
	for _, tc := range tests {
		// A row of claimColumns' types, and the claim's three parameters.
		sql := `SELECT 7::bigint, 'Job'::text, '[1]'::jsonb, 'default'::text, ` + tc.runAt + `::timestamptz,
			'aaaaaaaaaaaaaaaaaaaaaaaa'::text, ` + tc.createdAt + `::timestamptz, '{}'::jsonb
			FROM (SELECT $1::int, $2::bigint[], $3::bigint) p`
		jobs, err := claimBatch(ctx, conn, sql, nil, 10, nil, 0, nil)
		if _, rbErr := conn.Exec(ctx, "ROLLBACK"); rbErr != nil {
			t.Fatal(rbErr)
		}
		if err != nil {
			t.Errorf("%s: claimBatch: %v", tc.name, err)
			continue
		}
		if len(jobs) != 1 {
			t.Fatalf("%s: %d jobs, want 1", tc.name, len(jobs))
		}
		j := jobs[0]
		if (j.runAt == nil) != (tc.wantRunAt == nil) || (j.runAt != nil && !j.runAt.Equal(*tc.wantRunAt)) {
			t.Errorf("%s: runAt %v, want %v", tc.name, j.runAt, tc.wantRunAt)
		}
		if j.runAtInf != tc.wantRunInf || j.createdAtInf != tc.wantCr || j.bad != tc.wantBad || j.nulls != 0 {
			t.Errorf("%s: runAtInf %v, createdAtInf %v, bad %q, nulls %v; want %v, %v, %q, none",
				tc.name, j.runAtInf, j.createdAtInf, j.bad, j.nulls, tc.wantRunInf, tc.wantCr, tc.wantBad)
		}
		// Written back (bury, reinsert), each column is the value read.
		args := buryArgs(jobs, []string{j.bad})
		var same bool
		if err := conn.QueryRow(ctx, `SELECT ($1::timestamptz[])[1] IS NOT DISTINCT FROM `+tc.runAt+`::timestamptz
				AND ($2::timestamptz[])[1] = `+tc.createdAt+`::timestamptz`, args[4], args[6]).Scan(&same); err != nil {
			t.Fatalf("%s: write back: %v", tc.name, err)
		}
		if !same {
			t.Errorf("%s: written back as run_at %v, created_at %v; want %s, %s", tc.name, args[4], args[6], tc.runAt, tc.createdAt)
		}
		if r := reinsertArgs(jobs); r[4].([]pgtype.Timestamptz)[0] != args[4].([]pgtype.Timestamptz)[0] ||
			r[6].([]pgtype.Timestamptz)[0] != args[6].([]pgtype.Timestamptz)[0] {
			t.Errorf("%s: reinsert writes %v, %v; bury %v, %v", tc.name, r[4], r[6], args[4], args[6])
		}
	}
}
