package relay

import (
	"errors"

	"github.com/stagedrain/stagedrain/relay/internal/handoff"
)

// The exported errors of the package, for errors.Is: Run, CheckReady and
// the admin operations (relay/admin) return them, or errors that wrap them.

var (
	// ErrNotMigrated is returned by Run when the schema version recorded by
	// Migrate is older than the latest migration of this binary, or when
	// Migrate never ran on the schema (even if it holds a staged_jobs table,
	// such as the seed article's): run Migrate (stagedrain migrate) first.
	ErrNotMigrated = errors.New("schema not migrated")

	// ErrSchemaTooNew is returned by Run when the schema version recorded by
	// Migrate is newer than the latest migration of this binary: a newer
	// stagedrain migrated it, so upgrade this one.
	ErrSchemaTooNew = errors.New("schema too new")
)

// ErrPermission is returned by Run when its database role lacks a privilege
// the relay needs: found missing at start, or refused by PostgreSQL
// (SQLSTATE 42501, insufficient_privilege) later. Waiting does not fix it;
// a GRANT does.
var ErrPermission = errors.New("permission denied")

// ErrQueueConflict is returned by Run when another relay drains the same
// schema with a set of queues (Config.Queues) that overlaps this relay's
// without being equal, or when a relay for all queues and a relay with a
// list would run side by side: each would claim the other's rows.
var ErrQueueConflict = errors.New("queue conflict")

// ErrForeignFence is returned by Run when the relay's fence in Redis was
// taken by a relay of another PostgreSQL cluster (another system_identifier)
// whose database and schema have the same names: reading that deployment's
// record would delete rows unpushed. Give each its own RedisNamespace or
// Redis DB.
var ErrForeignFence = handoff.ErrForeign

// ErrNotReady is wrapped by every error of CheckReady.
var ErrNotReady = errors.New("not ready")
