package relay

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"slices"
	"strconv"
	"strings"

	"github.com/jackc/pgx/v5"

	sqlfiles "github.com/stagedrain/stagedrain/sql"
)

// migration is one file of sql/: NNN_name.sql (a migration),
// baseline_NNN.sql (the schema at version NNN, for fresh installs) or
// wake_NNN.sql (stagedrain_wake() as migration NNN defines it).
type migration struct {
	version int
	name    string
	body    string
}

// sqlSet is the files of sql/, each kind in version order.
type sqlSet struct {
	migrations []migration
	baselines  []migration
	wakes      []migration
	gems       []migration // gem_NNN.sql: the gem's table's own (gem_001.sql, gem_002.sql)
}

// readSQL reads sql/ by file name only: what a file holds is never looked
// into.
func readSQL() (sqlSet, error) {
	var set sqlSet
	entries, err := fs.ReadDir(sqlfiles.Files, ".")
	if err != nil {
		return set, err
	}
	for _, e := range entries {
		name := e.Name()
		stem, isSQL := strings.CutSuffix(name, ".sql")
		kind, num := &set.migrations, ""
		if rest, ok := strings.CutPrefix(stem, "baseline_"); ok {
			kind, num = &set.baselines, rest
		} else if rest, ok := strings.CutPrefix(stem, "wake_"); ok {
			kind, num = &set.wakes, rest
		} else if rest, ok := strings.CutPrefix(stem, "gem_"); ok {
			kind, num = &set.gems, rest
		} else {
			var ok bool
			num, _, ok = strings.Cut(stem, "_")
			isSQL = isSQL && ok
		}
		v, err := strconv.Atoi(num)
		if !isSQL || err != nil || len(num) != 3 || v <= 0 {
			return set, fmt.Errorf("file %q of sql/ is not named NNN_name.sql, baseline_NNN.sql, wake_NNN.sql or gem_NNN.sql", name)
		}
		body, err := fs.ReadFile(sqlfiles.Files, name)
		if err != nil {
			return set, err
		}
		*kind = append(*kind, migration{version: v, name: name, body: string(body)})
	}
	for _, ms := range []*[]migration{&set.migrations, &set.baselines, &set.wakes, &set.gems} {
		slices.SortFunc(*ms, func(a, b migration) int { return a.version - b.version })
		for i := 1; i < len(*ms); i++ {
			if (*ms)[i].version == (*ms)[i-1].version {
				return set, fmt.Errorf("sql/ has two files of version %d: %s and %s", (*ms)[i].version, (*ms)[i-1].name, (*ms)[i].name)
			}
		}
	}
	if len(set.migrations) == 0 {
		return set, errors.New("no migration files")
	}
	return set, nil
}

// latest returns the last of ms with a version at most v; false if none.
func latest(ms []migration, v int) (migration, bool) {
	for i := len(ms) - 1; i >= 0; i-- {
		if ms[i].version <= v {
			return ms[i], true
		}
	}
	return migration{}, false
}

// baseline returns the files a fresh install applies instead of the
// migrations up to the baseline's version (the wake file, then the
// baseline), and the names of those migrations; false when sql/ has no
// baseline.
func (set sqlSet) baseline() (files []migration, replaces []migration, ok bool, err error) {
	b, ok := latest(set.baselines, set.migrations[len(set.migrations)-1].version)
	if !ok {
		return nil, nil, false, nil
	}
	w, ok := latest(set.wakes, b.version)
	if !ok {
		return nil, nil, false, fmt.Errorf("%s: no wake_NNN.sql of version %d or lower", b.name, b.version)
	}
	for _, m := range set.migrations {
		if m.version <= b.version {
			replaces = append(replaces, m)
		}
	}
	if len(replaces) == 0 || replaces[len(replaces)-1].version != b.version {
		return nil, nil, false, fmt.Errorf("%s: no migration of version %d", b.name, b.version)
	}
	return []migration{w, b}, replaces, true, nil
}

// wakeFunction returns the current definition of stagedrain_wake(): the
// wake_NNN.sql of the highest NNN, and NNN.
func wakeFunction() (string, int, error) {
	return newest(func(set sqlSet) []migration { return set.wakes }, "wake_NNN.sql")
}

// gemFile returns the newest gem_NNN.sql (what Migrate adds to the gem's
// table besides the wake trigger), and NNN.
func gemFile() (string, int, error) {
	return newest(func(set sqlSet) []migration { return set.gems }, "gem_NNN.sql")
}

// newest returns the body and version of the last file of one kind of
// sql/ (kind picks it from the set; name names it in the error).
func newest(kind func(sqlSet) []migration, name string) (string, int, error) {
	set, err := readSQL()
	if err != nil {
		return "", 0, err
	}
	files := kind(set)
	if len(files) == 0 {
		return "", 0, errors.New("sql/ has no " + name)
	}
	f := files[len(files)-1]
	return f.body, f.version, nil
}

// latestVersion is the highest migration of sql/: the schema version this
// binary needs, and the newest it knows.
func latestVersion() (int, error) {
	set, err := readSQL()
	if err != nil {
		return 0, err
	}
	return set.migrations[len(set.migrations)-1].version, nil
}

// A MigrateOption changes what Migrate does.
type MigrateOption func(*migrateOptions)

type migrateOptions struct {
	source Source
}

// WithSource migrates schema for the relay of source src (Config.Source):
// SourceStagedJobs (or ""), the default, is Migrate's staged_jobs schema;
// SourceSidekiqStagedPush adds the wake trigger (the stagedrain_wake()
// function and a deferred constraint trigger) and sql/gem_002.sql's
// statement trigger (stagedrain_xid_first, with the mark's reader of the
// sequence) to the gem's table in schema, which must exist, and creates
// nothing else, no column changed. The wake trigger's comment
// records the version of the stagedrain_wake() it runs
// (MigrateResult.Current), which Run checks; a trigger of an older one gets
// the new function. Idempotent: once up to date, it writes nothing.
func WithSource(src Source) MigrateOption {
	return func(o *migrateOptions) { o.source = src }
}

// MigrateResult says what Migrate did.
type MigrateResult struct {
	Applied []string // files of sql/ applied now, in order (a fresh schema: the wake and baseline files, then migrations above the baseline)
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
//
// A fresh schema (no version recorded, no staged_jobs table) gets the
// baseline instead of the migrations it equals: wake_009.sql and
// baseline_009.sql, applied and reported in MigrateResult.Applied, and
// versions 1..9 recorded under their migrations' names, as an upgrade
// records them; then every later migration, as for any schema. A schema
// with a staged_jobs table of its own (the seed article's) is upgraded
// from 001 in place.
//
// Options: WithSource, for a relay of another source.
func Migrate(ctx context.Context, conn *pgx.Conn, schema string, opts ...MigrateOption) (MigrateResult, error) {
	var res MigrateResult
	var o migrateOptions
	for _, opt := range opts {
		opt(&o)
	}
	if err := validateSchemaName(schema); err != nil {
		return res, err
	}
	switch o.source {
	case "", SourceStagedJobs:
	case SourceSidekiqStagedPush:
		return migrateStagedPush(ctx, conn, schema)
	default:
		return res, CheckSource(o.source)
	}
	set, err := readSQL()
	if err != nil {
		return res, fmt.Errorf("read migrations: %w", err)
	}
	ms := set.migrations
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
		if len(done) == 0 {
			if done, err = applyBaseline(ctx, tx, set, &res); err != nil {
				return err
			}
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

// applyBaseline gives a fresh schema, one with no staged_jobs table, sql/'s
// baseline, records the migrations it replaces, and returns their
// versions; nothing (and no error) for any other schema, or when sql/ has
// no baseline.
func applyBaseline(ctx context.Context, tx pgx.Tx, set sqlSet, res *MigrateResult) ([]int, error) {
	var fresh bool
	if err := tx.QueryRow(ctx, `SELECT to_regclass('staged_jobs') IS NULL`).Scan(&fresh); err != nil {
		return nil, fmt.Errorf("look up staged_jobs: %w", err)
	}
	if !fresh {
		return nil, nil
	}
	files, replaces, ok, err := set.baseline()
	if err != nil || !ok {
		return nil, err
	}
	for _, f := range files {
		if _, err := tx.Exec(ctx, f.body, pgx.QueryExecModeSimpleProtocol); err != nil {
			return nil, fmt.Errorf("apply %s: %w", f.name, err)
		}
		res.Applied = append(res.Applied, f.name)
	}
	var done []int
	for _, m := range replaces {
		if _, err := tx.Exec(ctx, `INSERT INTO stagedrain_migrations (version, name) VALUES ($1, $2)`, m.version, m.name); err != nil {
			return nil, fmt.Errorf("record %s: %w", m.name, err)
		}
		done = append(done, m.version)
	}
	return done, nil
}
