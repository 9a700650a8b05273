package handoff

import "strings"

// Keys are the relay's own Redis keys of one handoff: the fence hash and
// the record hash. The relay builds them (relay/keys.go); the handoff
// derives from them the pair of each cluster slot (slot). Fence must end in
// "fence".
type Keys struct {
	Fence, Record string
}

// slot returns the fence and record hashes of one cluster slot.
func (k Keys) slot(slot int) Keys {
	base := strings.TrimSuffix(k.Fence, "fence") + "{" + slotTag(slot) + "}:"
	return Keys{Fence: base + "fence", Record: base + "handoff"}
}
