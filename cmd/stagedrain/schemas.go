package main

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"

	"github.com/jackc/pgx/v5"
	"go.uber.org/zap"

	"github.com/stagedrain/stagedrain/relay"
	"github.com/stagedrain/stagedrain/relay/admin"
)

// registerSchemas declares --schemas, of the commands that take a list of
// schemas (relay.ParseSchemas) instead of --schema.
func registerSchemas(f *flagSet, p *string, usage string) {
	f.fs.StringVar(p, "schemas", "", usage)
	f.env("schemas", "STAGEDRAIN_SCHEMAS")
	f.required("schemas")
}

// schemasFlag checks --schemas, after parse: nil when it is not given, its
// items when it is. With --schema too, a usage error: which one is meant?
func schemasFlag(f *flagSet, list string) ([]string, error) {
	if !f.isSet("schemas") {
		return nil, nil
	}
	if f.isSet("schema") {
		return nil, usagef("%s: %s and %s cannot be used together: --schema names one schema, --schemas a list",
			f.cmd, f.source("schema"), f.source("schemas"))
	}
	items, err := relay.ParseSchemas(list)
	if err != nil {
		reason := err.Error()
		if fe := (*relay.FieldError)(nil); errors.As(err, &fe) {
			reason = fe.Reason
		}
		return nil, usagef("%s: %s %s", f.cmd, f.source("schemas"), reason)
	}
	return items, nil
}

// sourceTable is the table a source drains.
func sourceTable(src relay.Source) string {
	if src == relay.SourceSidekiqStagedPush {
		return "sidekiq_staged_push_jobs"
	}
	return "staged_jobs"
}

// expandSchemas returns the schemas items name, sorted bytewise: every
// name, whether it exists or not, and the schemas each pattern matches
// (admin.ListSchemas with table). noMatch is called with each pattern that
// matches none.
func expandSchemas(ctx context.Context, db admin.DB, items []string, table string, noMatch func(pattern string)) ([]string, error) {
	var schemas []string
	for _, item := range items {
		if !admin.IsSchemaPattern(item) {
			schemas = append(schemas, item)
			continue
		}
		found, err := admin.ListSchemas(ctx, db, []string{item}, table)
		if err != nil {
			return nil, err
		}
		if len(found) == 0 {
			noMatch(item)
		}
		schemas = append(schemas, found...)
	}
	slices.Sort(schemas)
	return slices.Compact(schemas), nil
}

// migrateSchemas migrates each schema of a list (relay.ParseSchemas's
// items): the names, created if missing (with src sidekiq_staged_push, the
// gem's table must be there), and the schemas the patterns match, those
// that exist (with src sidekiq_staged_push, those holding the gem's table).
// It logs a line per schema, as migrate does for one, and a warning for a
// pattern that matches none. A schema that fails is logged and the others
// are migrated; the error then names those that failed. No schema at all is
// an error.
func migrateSchemas(ctx context.Context, databaseURL string, items []string, src relay.Source, log *zap.Logger) error {
	connect := func() (*pgx.Conn, error) {
		conn, err := connectDB(ctx, databaseURL, "stagedrain migrate")
		if err != nil {
			return nil, fmt.Errorf("migrate: connect to %s: %w", relay.DescribeDatabase(databaseURL), err)
		}
		return conn, nil
	}
	conn, err := connect()
	if err != nil {
		return err
	}
	defer func() { conn.Close(context.WithoutCancel(ctx)) }()
	table := ""
	if src == relay.SourceSidekiqStagedPush {
		table = sourceTable(src)
	}
	schemas, err := expandSchemas(ctx, conn, items, table, func(pattern string) {
		if table != "" {
			log.Warn("no schema matches the pattern", zap.String("pattern", pattern), zap.String("table", table))
		} else {
			log.Warn("no schema matches the pattern", zap.String("pattern", pattern))
		}
	})
	if err != nil {
		return fmt.Errorf("migrate: %w", err)
	}
	if len(schemas) == 0 {
		return &schemasError{msg: fmt.Sprintf("migrate: no schema matches %q", strings.Join(items, ","))}
	}
	var failed []string
	for i, schema := range schemas {
		if conn.IsClosed() { // the last migration broke it
			if conn, err = connect(); err != nil {
				return fmt.Errorf("%w; not migrated: %s", err, strings.Join(append(failed, schemas[i:]...), ", "))
			}
		}
		res, err := relay.Migrate(ctx, conn, schema, relay.WithSource(src))
		if ctx.Err() != nil {
			return nil // stopped (SIGINT, SIGTERM)
		}
		if err != nil {
			log.Error("migrate failed", zap.String("schema", schema), zap.Error(err))
			failed = append(failed, schema)
			continue
		}
		logMigrated(log, schema, src, res)
	}
	if len(failed) > 0 {
		return &schemasError{msg: fmt.Sprintf("migrate: %d of %d schemas failed: %s (see the log)", len(failed), len(schemas), strings.Join(failed, ", "))}
	}
	return nil
}

// schemasError is migrateSchemas's error when PostgreSQL answered: no
// schema matched, or some schemas failed (each logged). Retrying would not
// help.
type schemasError struct{ msg string }

func (e *schemasError) Error() string { return e.msg }
