package handoff

import (
	"strconv"
	"strings"
)

// Command is one command of an op, as the push script receives it.
type Command struct {
	Name string   // a Redis command, or a Lua op of the script (BullMQAdd)
	Keys []string // its keys, in KEYS
	Args []any    // its arguments, in ARGV
}

// Commands reads op i of u back out of the script's KEYS and ARGV layout,
// as the script reads it (handoffScript): the keys whose existence skips
// the op, and its commands. A length guard's keys (Limit) are not shown.
func (u *Unit) Commands(i int) (guards []string, cmds []Command) {
	op := &u.ops[i]
	k, a := op.k0, op.a0
	ng, nlen := 0, 0
	switch g := u.args[a].(type) {
	case int:
		ng = g
	case string: // "<guards> <cmd> <limit>": a key per term of cmd
		n, cmd, _ := strings.Cut(g, " ")
		ng, _ = strconv.Atoi(n)
		cmd, _, _ = strings.Cut(cmd, " ")
		nlen = strings.Count(cmd, "+") + 1
	}
	ncmds := u.args[a+1].(int)
	a += 3
	guards = u.keys[k : k+ng]
	k += ng + nlen
	for range ncmds {
		name, nkeys, nargs := u.args[a].(string), u.args[a+1].(int), u.args[a+2].(int)
		cmds = append(cmds, Command{Name: name, Keys: u.keys[k : k+nkeys], Args: u.args[a+3 : a+3+nargs]})
		k += nkeys
		a += 3 + nargs
	}
	return guards, cmds
}
