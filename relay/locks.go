package relay

// The advisory locks the relay and its admin operations take, by name.
// Each name is hashed to a lock key by lockKeySQL, in PostgreSQL.

// lockKeySQL turns the lock name $1 into the bigint key of a session or
// transaction advisory lock.
const lockKeySQL = `hashtextextended($1, 0)`

const (
	tryLockSQL = `SELECT pg_try_advisory_lock(` + lockKeySQL + `)`
	unlockSQL  = `SELECT pg_advisory_unlock(` + lockKeySQL + `)`
	// migrateLockSQL serializes the migrations of one schema.
	migrateLockSQL = `SELECT pg_advisory_xact_lock(` + lockKeySQL + `)`
)

// leaderLockName is the name of the leader lock of schema's relays that
// drain group ("" for every queue; else the sorted queue list, comma
// separated): one leader per name.
func leaderLockName(schema, group string) string {
	if group == "" {
		return "stagedrain:" + schema
	}
	return "stagedrain:" + schema + ":queues=" + group
}

// migrateLockName is the name of the lock Migrate holds on schema.
func migrateLockName(schema string) string {
	return "stagedrain:migrate:" + schema
}
