package handoff

import (
	"strconv"
	"strings"
	"sync"
)

// Redis Cluster hashes every key to one of 16384 slots, and runs a script
// only when all of its keys are in one slot: on a cluster, the atomic unit
// is a slot. These helpers compute a key's slot as Redis does, and name the
// relay's own keys of a slot.

const clusterSlots = 16384

// KeySlot returns the cluster slot of key: CRC16 (XMODEM) of its hash tag,
// the part between the first { and the next }, when that part is not empty;
// otherwise of the whole key.
func KeySlot(key string) int {
	if s := strings.IndexByte(key, '{'); s >= 0 {
		if e := strings.IndexByte(key[s+1:], '}'); e > 0 {
			key = key[s+1 : s+1+e]
		}
	}
	return int(crc16(key)) % clusterSlots
}

// crc16 is CRC-16/XMODEM (polynomial 0x1021, initial value 0), the checksum
// of Redis Cluster's key hashing.
func crc16(s string) uint16 {
	var crc uint16
	for i := 0; i < len(s); i++ {
		crc ^= uint16(s[i]) << 8
		for range 8 {
			if crc&0x8000 != 0 {
				crc = crc<<1 ^ 0x1021
			} else {
				crc <<= 1
			}
		}
	}
	return crc
}

var (
	slotTagsOnce sync.Once
	slotTags     []string
)

// slotTag returns a short hash tag whose slot is slot: the shortest string
// of digits and lowercase letters (the first in that order) that hashes to
// it. "{" + slotTag(s) + "}" in a key puts the key in slot s.
func slotTag(slot int) string {
	slotTagsOnce.Do(func() {
		slotTags = make([]string, clusterSlots)
		left := clusterSlots
		const alphabet = "0123456789abcdefghijklmnopqrstuvwxyz"
		var walk func(prefix []byte, n int)
		walk = func(prefix []byte, n int) {
			if left == 0 {
				return
			}
			if n == 0 {
				s := KeySlot(string(prefix))
				if slotTags[s] == "" {
					slotTags[s] = string(prefix)
					left--
				}
				return
			}
			for i := 0; i < len(alphabet); i++ {
				walk(append(prefix, alphabet[i]), n-1)
			}
		}
		for n := 1; left > 0; n++ {
			walk(make([]byte, 0, n), n)
		}
	})
	return slotTags[slot]
}

// slotRef names a record field in the record hash of a slot.
func slotRef(slot int, field string) string { return strconv.Itoa(slot) + "/" + field }

// parseSlotRef splits a slotRef.
func parseSlotRef(ref string) (slot int, field string) {
	i := strings.IndexByte(ref, '/')
	slot, _ = strconv.Atoi(ref[:i])
	return slot, ref[i+1:]
}
