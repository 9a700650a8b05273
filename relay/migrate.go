package relay

import (
	"context"
	"fmt"
	"io/fs"
	"slices"
	"strconv"
	"strings"

	"github.com/jackc/pgx/v5"

	sqlfiles "github.com/stagedrain/stagedrain/sql"
)

// migration is one file of sql/: NNN_name.sql.
type migration struct {
	version int
	name    string
	body    string
}

func migrations() ([]migration, error) {
	entries, err := fs.ReadDir(sqlfiles.Files, ".")
	if err != nil {
		return nil, err
	}
	var ms []migration
	for _, e := range entries {
		name := e.Name()
		num, _, ok := strings.Cut(name, "_")
		v, err := strconv.Atoi(num)
		if !ok || err != nil || !strings.HasSuffix(name, ".sql") {
			return nil, fmt.Errorf("migration file %q is not named NNN_name.sql", name)
		}
		body, err := fs.ReadFile(sqlfiles.Files, name)
		if err != nil {
			return nil, err
		}
		ms = append(ms, migration{version: v, name: name, body: string(body)})
	}
	slices.SortFunc(ms, func(a, b migration) int { return a.version - b.version })
	return ms, nil
}

// latestVersion is the highest migration of sql/: the schema version this
// binary needs, and the newest it knows.
func latestVersion() (int, error) {
	ms, err := migrations()
	if err != nil {
		return 0, err
	}
	if len(ms) == 0 {
		return 0, fmt.Errorf("no migration files")
	}
	return ms[len(ms)-1].version, nil
}

// MigrateResult says what Migrate did.
type MigrateResult struct {
	Applied []string // migration files applied now, in order
	Current int      // the schema's version after Migrate
}

// Migrate creates schema (if missing), its staged_jobs table and its NOTIFY
// trigger, applying each migration of sql/ not yet recorded in the schema's
// stagedrain_migrations table, all in one transaction. It is idempotent, and
// safe to run from several processes at once: a transaction-level advisory
// lock serializes them, and the later ones find nothing left to do. A
// statement that waits more than 5s for a table lock (an app transaction
// holding staged_jobs) fails the migration instead of stalling the app's
// writes queued behind it; run it again when the table is quiet. Rows of a
// seed table with a NULL job_name or job_args fail it too, changing nothing:
// its error counts them and says how to find them.
func Migrate(ctx context.Context, conn *pgx.Conn, schema string) (MigrateResult, error) {
	var res MigrateResult
	if err := validateSchemaName(schema); err != nil {
		return res, err
	}
	ms, err := migrations()
	if err != nil {
		return res, fmt.Errorf("read migrations: %w", err)
	}
	quoted := pgx.Identifier{schema}.Sanitize()
	err = pgx.BeginFunc(ctx, conn, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, migrateLockSQL, migrateLockName(schema)); err != nil {
			return fmt.Errorf("take migration lock: %w", err)
		}
		// CREATE SCHEMA IF NOT EXISTS still needs CREATE on the database;
		// skip it when the schema is there, so an app role that owns only
		// its schema can migrate.
		var exists bool
		if err := tx.QueryRow(ctx, `SELECT EXISTS (SELECT FROM pg_namespace WHERE nspname = $1)`, schema).Scan(&exists); err != nil {
			return fmt.Errorf("look up schema: %w", err)
		}
		if !exists {
			if _, err := tx.Exec(ctx, `CREATE SCHEMA IF NOT EXISTS `+quoted); err != nil {
				return fmt.Errorf("create schema: %w", err)
			}
		}
		if _, err := tx.Exec(ctx, `SET LOCAL search_path TO `+quoted); err != nil {
			return fmt.Errorf("set search_path: %w", err)
		}
		// An ALTER TABLE that waits for a lock makes every INSERT of the
		// app queue behind it: rather fail than stall the app.
		if _, err := tx.Exec(ctx, `SET LOCAL lock_timeout = '5s'`); err != nil {
			return fmt.Errorf("set lock_timeout: %w", err)
		}
		if _, err := tx.Exec(ctx, `CREATE TABLE IF NOT EXISTS stagedrain_migrations (
			version    INT PRIMARY KEY,
			name       TEXT NOT NULL,
			applied_at TIMESTAMPTZ NOT NULL DEFAULT now()
		)`); err != nil {
			return fmt.Errorf("create stagedrain_migrations: %w", err)
		}
		rows, err := tx.Query(ctx, `SELECT version FROM stagedrain_migrations`)
		if err != nil {
			return fmt.Errorf("read stagedrain_migrations: %w", err)
		}
		done, err := pgx.CollectRows(rows, pgx.RowTo[int])
		if err != nil {
			return fmt.Errorf("read stagedrain_migrations: %w", err)
		}
		for _, m := range ms {
			if slices.Contains(done, m.version) {
				res.Current = max(res.Current, m.version)
				continue
			}
			if _, err := tx.Exec(ctx, m.body, pgx.QueryExecModeSimpleProtocol); err != nil {
				return fmt.Errorf("apply %s: %w", m.name, err)
			}
			if _, err := tx.Exec(ctx, `INSERT INTO stagedrain_migrations (version, name) VALUES ($1, $2)`, m.version, m.name); err != nil {
				return fmt.Errorf("record %s: %w", m.name, err)
			}
			res.Applied = append(res.Applied, m.name)
			res.Current = max(res.Current, m.version)
		}
		return nil
	})
	if err != nil {
		return MigrateResult{}, fmt.Errorf("migrate schema %q: %w", schema, err)
	}
	return res, nil
}
