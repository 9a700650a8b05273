package main

import (
	"strconv"
	"strings"
)

// leaderSQL and parseApplicationName are left for chaos_test.go, which
// finds the leader's session itself; relay.ReadStatus (Leader) does it for
// status. Delete them once chaos_test.go reads relay.ReadStatus.

// leaderSQL finds the session holding the advisory lock named $1 (the
// relay's leaderLockName) in this database, and when it connected.
const leaderSQL = `SELECT a.pid, coalesce(a.application_name, ''), coalesce(host(a.client_addr), ''), a.backend_start
	FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
	WHERE l.locktype = 'advisory' AND l.objsubid = 1 AND l.granted
	  AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
	  AND (l.classid::bigint << 32 | l.objid::bigint) = hashtextextended($1, 0)`

// parseApplicationName reads host and pid out of the relay's
// "stagedrain leader <host>:<pid>"; "", 0 from any other name.
func parseApplicationName(name string) (host string, pid int) {
	rest, ok := strings.CutPrefix(name, "stagedrain leader ")
	if !ok {
		return "", 0
	}
	i := strings.LastIndexByte(rest, ':')
	if i < 0 {
		return "", 0
	}
	pid, err := strconv.Atoi(rest[i+1:])
	if err != nil {
		return "", 0
	}
	return rest[:i], pid
}
