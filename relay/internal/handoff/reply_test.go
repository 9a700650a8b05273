package handoff

import "testing"

// Only a Redis error reply known to refuse the same job again buries it;
// every other one, an unknown code included, leaves it staged, to wait.
// The replies are as redis.pcall hands them to the push script, from the
// sources of Redis 6.2.16 (src/server.c createSharedObjects, src/scripting.c
// luaRedisGenericCommand and luaPushError, which prepends "<chunk>: <line>: "
// to the raw "-CODE ...\r\n" reply) and 7.0.15 / 7.2.5 (src/script.c
// scriptVerifyACL, scriptVerifyWriteCommandAllow, scriptVerifyOOM;
// src/script_lua.c luaPushErrorBuff, which strips the "-" and "\r\n" and
// gives a codeless message the code ERR), plus src/t_string.c
// checkStringLength, src/networking.c processMultibulkBuffer and
// src/cluster.c getNodeByQuery. 33 is the line of the push script's pcall.
func TestIsPermanentReply(t *testing.T) {
	tests := []struct {
		reply     string
		permanent bool
	}{
		// A command's own reply, in every version.
		{"WRONGTYPE Operation against a key holding the wrong kind of value", true},
		{"ERR string exceeds maximum allowed size (proto-max-bulk-len)", true},
		{"ERR Protocol error: invalid bulk length", true},
		{"CROSSSLOT Keys in request don't hash to the same slot", true},
		{string(errCrossSlot), true},
		{"ERR value is not a valid float", false},
		{"LOADING Redis is loading the dataset in memory", false},
		{"BUSY Redis is busy running a script. You can only call SCRIPT KILL or SHUTDOWN NOSAVE.", false},
		{"TRYAGAIN Multiple keys request during rehashing of slot", false},
		{"CLUSTERDOWN The cluster is down", false},
		{"MASTERDOWN Link with MASTER is down and replica-serve-stale-data is set to 'no'.", false},
		{"MOVED 3999 127.0.0.1:6381", false},
		{"NOPERM User relay has no permissions to access the 'queue:x' key", false},
		// Redis 7.x: raised before the command runs.
		{"OOM command not allowed when used memory > 'maxmemory'.", false},
		{"READONLY You can't write against a read only replica.", false},
		{"MISCONF Redis is configured to save RDB snapshots, but it's currently unable to persist to disk. Commands that may modify the data set are disabled, because this instance is configured to report errors during writes if RDB snapshotting fails (stop-writes-on-bgsave-error option). Please check the Redis logs for details about the RDB error.", false},
		{"MISCONF Errors writing to the AOF file: No space left on device", false},
		{"NOREPLICAS Not enough good replicas to write.", false},
		{"ERR The user executing the script can't run this command or subcommand", false},              // 7.0
		{"ERR ACL failure in script: User relay has no permissions to run the 'lpush' command", false}, // 7.2
		{"ERR ACL failure in script: No permissions to access a key", false},                           // 7.2
		{"ERR Write commands are not allowed from read-only scripts.", false},                          // 7.x
		{"ERR May-replicate commands are not allowed when client pause write.", false},                 // 7.x
		{"ERR Script attempted to access a non local key in a cluster node", false},                    // 7.x
		{"ERR Script attempted to execute a command while the cluster is down", false},                 // 7.x
		// Redis 6.2 and older: raised before the command runs.
		{"@user_script: 33: -OOM command not allowed when used memory > 'maxmemory'.\r\n", false},
		{"@user_script: 33: -READONLY You can't write against a read only replica.\r\n", false},
		{"@user_script: 33: -MISCONF Redis is configured to save RDB snapshots, but it is currently not able to persist on disk. Commands that may modify the data set are disabled, because this instance is configured to report errors during writes if RDB snapshotting fails (stop-writes-on-bgsave-error option). Please check the Redis logs for details about the RDB error.\r\n", false},
		{"@user_script: 33: -MISCONF Errors writing to the AOF file: No space left on device\r\n", false},
		{"@user_script: 33: -NOREPLICAS Not enough good replicas to write.\r\n", false},
		{"@user_script: 33: The user executing the script can't run this command or subcommand", false},
		{"@user_script: 33: The user executing the script can't access at least one of the keys mentioned in the command arguments", false},
		{"@user_script: 33: Lua script attempted to access a non local key in a cluster node", false},
		{"@user_script: 33: -WRONGTYPE Operation against a key holding the wrong kind of value\r\n", true},
		// Codes this relay does not know wait.
		{"FUTURECODE a reply a later Redis may add", false},
		{"OOMPH not a code we know", false},
		{"", false},
	}
	for _, tc := range tests {
		if got := Permanent(replyErr(tc.reply)); got != tc.permanent {
			t.Errorf("Permanent(%q) = %v, want %v", tc.reply, got, tc.permanent)
		}
	}
	for reply, want := range map[string][2]string{
		"@user_script: 33: -OOM command not allowed when used memory > 'maxmemory'.\r\n": {"OOM", "command not allowed when used memory > 'maxmemory'."},
		"@user_script: 33: The user executing the script can't run this command":         {"", "The user executing the script can't run this command"},
		"OOM command not allowed when used memory > 'maxmemory'.":                        {"OOM", "command not allowed when used memory > 'maxmemory'."},
		"@user_script: x: -OOM not a position":                                           {"@user_script:", "x: -OOM not a position"},
	} {
		if code, msg := replyCode(reply); code != want[0] || msg != want[1] {
			t.Errorf("replyCode(%q) = %q, %q; want %q, %q", reply, code, msg, want[0], want[1])
		}
	}
}
