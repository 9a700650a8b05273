package handoff

import "testing"

// TestKeySlot checks KeySlot against slots Redis computes (CLUSTER KEYSLOT),
// and that slotTag covers every slot.
func TestKeySlot(t *testing.T) {
	for key, want := range map[string]int{
		"foo":                  12182,
		"123456789":            12739,
		"{user1000}.following": 3443,
		"foo{}{bar}":           8363,
		"foo{{bar}}zap":        4015,
		"foo{bar}{zap}":        5061,
	} {
		if got := KeySlot(key); got != want {
			t.Errorf("KeySlot(%q) = %d, want %d", key, got, want)
		}
	}
	for s := range clusterSlots {
		if got := KeySlot("{" + slotTag(s) + "}x"); got != s {
			t.Fatalf("slotTag(%d) = %q, in slot %d", s, slotTag(s), got)
		}
	}
}
