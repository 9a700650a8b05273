// Package handoff owns the relay's atomic push step into Redis and every
// Lua script of it: the fence that refuses a deposed leader, the record
// that makes a push safe to run twice and settles one whose reply was
// lost, the layout of a batch's ops in the script's KEYS and ARGV (Unit,
// the one encoder; settle, the one decoder), and the split of a push by
// Redis Cluster slot.
//
// A target builds a batch into a Unit: Begin starts an op (the rows it
// delivers, and guard keys whose existence skips it), Limit adds a length
// guard (backpressure), Command, Variadic and Call add its commands. A
// command's name is a Redis command or one of the script's own Lua ops
// (BullMQAdd): a target that needs a new kind of op adds it here, as a
// name of this package's API. After Push, each Op says what became of it.
//
// The relay calls Ready, Push, Committed, Uncommitted, Abandon and Tidy
// around each batch (see handoff.go for the protocol).
package handoff
