package handoff

import "strings"

// Permanent reports whether err, Redis's error reply to one command
// of the push script, is one the same job would get again, however long it
// waited: the job is poison, and is buried. Only replies known to be so
// are: WRONGTYPE (the queue's key holds another type), a value over
// proto-max-bulk-len, and CROSSSLOT (the job's keys are in several cluster
// slots, errCrossSlot). Any other reply, OOM, READONLY during a failover,
// LOADING, BUSY, TRYAGAIN, CLUSTERDOWN, MASTERDOWN, NOREPLICAS, MISCONF, an
// ACL's denial, and every code this relay does not know, may pass or be
// fixed by an operator for every job alike: the job waits, staged.
func Permanent(err error) bool {
	code, msg := replyCode(err.Error())
	switch code {
	case "WRONGTYPE", "CROSSSLOT":
		return true
	case "ERR":
		// src/t_string.c checkStringLength; src/networking.c
		// processMultibulkBuffer (a bulk over proto-max-bulk-len; Redis
		// closes the connection after it).
		return strings.HasPrefix(msg, "string exceeds maximum allowed size") ||
			strings.HasPrefix(msg, "Protocol error: invalid bulk length")
	}
	return false
}

// replyCode splits an error reply that redis.pcall returned into its code
// (OOM, WRONGTYPE, ERR, ...; "" if it has none) and message. A command's
// own error reply reads "CODE message", in every version. An error Redis
// raises before running the command (OOM, READONLY, MISCONF, NOREPLICAS, an
// ACL's denial) reads the same from Redis 7.0 (luaPushErrorBuff, in
// src/script_lua.c, parses "-CODE message" and prefixes a codeless message
// with ERR), but in 6.2 and older luaPushError (src/scripting.c) prepends
// the script's position to the reply as Redis would send it, "-" and
// "\r\n" included ("@user_script: 10: -OOM command not allowed ...\r\n"),
// or to a message with no code at all ("@user_script: 10: The user
// executing the script can't run this command or subcommand").
func replyCode(reply string) (code, msg string) {
	s := strings.TrimRight(reply, "\r\n")
	if rest, ok := strings.CutPrefix(s, "@"); ok {
		if _, rest, ok = strings.Cut(rest, ": "); ok {
			if line, after, ok := strings.Cut(rest, ": "); ok && line != "" && strings.Trim(line, "0123456789") == "" {
				after, ok = strings.CutPrefix(after, "-")
				if !ok {
					return "", after
				}
				s = after
			}
		}
	}
	code, msg, _ = strings.Cut(s, " ")
	return code, msg
}
