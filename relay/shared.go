package relay

import (
	"github.com/stagedrain/stagedrain/relay/internal/keys"
	"github.com/stagedrain/stagedrain/relay/internal/pgschema"
)

// What the relay shares with its admin operations (package relay/admin)
// lives in relay/internal/pgschema and relay/internal/keys; these are its
// names here.

const (
	// claimColumns are the columns a batch reads, in stagedJob's scan
	// order.
	claimColumns = pgschema.ClaimColumns
	// sidekiqStagedPushTable is the gem's table.
	sidekiqStagedPushTable = pgschema.StagedPushTable
	// stagedPushPoison is mapStagedPush's checks, in SQL.
	stagedPushPoison = pgschema.StagedPushPoison
)

var (
	// leaderLockName names the leader lock of a schema's relays that drain
	// a group ("" for every queue).
	leaderLockName = pgschema.LeaderLockName
	// groupNameWords spells a group for its name locks.
	groupNameWords = pgschema.GroupNameWords
	// pausedKey is the hash in which the leaders publish what backpressure
	// pauses (backpressure.go).
	pausedKey = keys.Paused
)
