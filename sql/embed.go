// Package sql holds stagedrain's schema migrations, embedded into the binary.
//
// Each file NNN_name.sql is one migration, applied once per schema in version
// order by relay.Migrate. Files use unqualified names: Migrate sets the
// search_path to the target schema for the migration's transaction, so the
// schema name is quoted in exactly one place.
package sql

import "embed"

// Files holds the migration files.
//
//go:embed *.sql
var Files embed.FS
