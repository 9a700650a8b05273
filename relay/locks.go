package relay

// The advisory locks the relay and its admin operations take, by name,
// and the statements that take them. The leader and migrate locks are
// one-key locks, each name hashed to a key by lockKeySQL in PostgreSQL;
// the group and gate locks are two-key locks (hashtext of the name, and a
// group or a shard).

// lockKeySQL turns the lock name $1 into the bigint key of a session or
// transaction advisory lock.
const lockKeySQL = `hashtextextended($1, 0)`

const (
	tryLockSQL = `SELECT pg_try_advisory_lock(` + lockKeySQL + `)`
	unlockSQL  = `SELECT pg_advisory_unlock(` + lockKeySQL + `)`
	// migrateLockSQL serializes the migrations of one schema.
	migrateLockSQL = `SELECT pg_advisory_xact_lock(` + lockKeySQL + `)`
)

// migrateLockName is the name of the lock Migrate holds on schema.
func migrateLockName(schema string) string {
	return "stagedrain:migrate:" + schema
}

// Every relay says which group it belongs to with session advisory locks
// on its lock connection, taken shared (so they never wait) from before it
// first tries for the leader lock until the connection closes; two-key
// locks whose second key is hashtext of the group (the sorted, comma-joined
// queue list; "" for all queues):
//
//	('stagedrain-group:<schema>', group)        by every relay
//	('stagedrain-queue:<schema>:<queue>', group) by a relay with a list,
//	                                             one per queue
//	('stagedrain-group-name:<schema>:<g>:<i>', word i of groupNameWords)
//	                                             by a relay with a list,
//	                                             i = 0, 1, ... (<g> is the
//	                                             group's key as pg_locks
//	                                             shows it: hashtext of the
//	                                             group, unsigned)
//
// The last spell the group's list out, so that admin.ReadStatus can name each
// group and find its leader lock from pg_locks alone: hashtext cannot be
// read back, and no other session-lived place in PostgreSQL holds a
// string as long as a list of queues (application_name keeps 63 bytes).
//
// Then it looks in pg_locks for a conflicting relay: another group holding
// one of its queues, or, between the all-queues group and the list groups,
// any member of the other kind. Each relay takes its locks before it looks,
// so of two conflicting relays that start at the same moment the second to
// look sees the first (both may refuse). A relay of a stagedrain without
// --queues support takes no such lock and is not seen.
const (
	// $1 the schema, $2 the group, $3 its queues, $4 groupNameWords($2).
	groupLockSQL = `SELECT pg_advisory_lock_shared(hashtext('stagedrain-group:' || $1), hashtext($2)),
		(SELECT count(pg_advisory_lock_shared(hashtext('stagedrain-queue:' || $1 || ':' || q), hashtext($2))) FROM unnest($3::text[]) q),
		(SELECT count(pg_advisory_lock_shared(hashtext(` + groupNameKeySQL + `), w))
			FROM unnest($4::int4[]) WITH ORDINALITY AS t(w, n))`
	// groupNameKeySQL names the lock of word n-1 of the name of group $2
	// in schema $1.
	groupNameKeySQL = `'stagedrain-group-name:' || $1 || ':' || (hashtext($2)::bigint & 4294967295) || ':' || (n - 1)`
	// The first conflicting relay's application_name, and the queue it
	// shares ("" when the conflict is the all-queues group). Advisory
	// two-key locks show in pg_locks as classid, objid (unsigned) with
	// objsubid 2.
	groupConflictSQL = `WITH k AS (
			SELECT q AS queue, hashtext('stagedrain-queue:' || $1 || ':' || q)::bigint & 4294967295 AS key FROM unnest($3::text[]) q
			UNION ALL
			SELECT '', hashtext('stagedrain-group:' || $1)::bigint & 4294967295)
		SELECT coalesce(a.application_name, ''), k.queue
		FROM k JOIN pg_locks l ON l.locktype = 'advisory' AND l.objsubid = 2
			AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
			AND l.classid::bigint = k.key
			AND l.objid::bigint <> hashtext($2)::bigint & 4294967295
		LEFT JOIN pg_stat_activity a ON a.pid = l.pid
		WHERE k.queue <> '' OR $2 = '' OR l.objid::bigint = hashtext('')::bigint & 4294967295
		ORDER BY k.queue DESC LIMIT 1`
)

// Each gate lock has 16 shards (two-key advisory locks: hashtext(name),
// shard); a committing backend uses shard pg_backend_pid() % 16.
const (
	// Every shard of each lock of $1 in turn, exclusively, then of each
	// lock of $2, shared (gateKeys). A lock_timeout part way leaves the
	// shards before it held, which the relay gives back (see
	// gate.inProgress).
	gateLockSQL = `SELECT pg_advisory_lock(hashtext(k), s) FROM unnest($1::text[]) k, generate_series(0, 15) s
		UNION ALL SELECT pg_advisory_lock_shared(hashtext(k), s) FROM unnest($2::text[]) k, generate_series(0, 15) s`
	// Unlocking a shard not held only raises a WARNING.
	gateUnlockSQL = `SELECT pg_advisory_unlock(hashtext(k), s) FROM unnest($1::text[]) k, generate_series(0, 15) s
		UNION ALL SELECT pg_advisory_unlock_shared(hashtext(k), s) FROM unnest($2::text[]) k, generate_series(0, 15) s`
)

// idleLockName is the gate's lock of schema (sql/010_wake_when_idle.sql,
// sql/015_wake_one_look.sql): held while a relay of it is idle, so that
// commits notify.
func idleLockName(schema string) string { return "stagedrain-idle:" + schema }

// gateKeys are the names of the locks a relay holds while it is idle: for
// a relay of all queues, the schema's idle lock, exclusively; for a relay
// of a list of queues, each queue's, exclusively, and the schema's, shared
// (sql/015_wake_one_look.sql: a commit's trigger looks at the schema's
// alone, and asks the precise question only when a relay holds it).
type gateKeys struct {
	excl, shared []string
}

// args are gateLockSQL's and gateUnlockSQL's arguments.
func (k gateKeys) args() []any { return []any{k.excl, k.shared} }

// add appends o's keys to k's.
func (k *gateKeys) add(o gateKeys) {
	k.excl = append(k.excl, o.excl...)
	k.shared = append(k.shared, o.shared...)
}

// gateLockNames are the gate's locks for a relay of queues, or of all
// queues when queues is empty.
func gateLockNames(schema string, queues []string) gateKeys {
	if len(queues) == 0 {
		return gateKeys{excl: []string{idleLockName(schema)}}
	}
	k := gateKeys{shared: []string{idleLockName(schema)}}
	for _, q := range queues {
		k.excl = append(k.excl, idleLockName(schema)+":"+q)
	}
	return k
}
