package pgschema

import "testing"

// A group's name locks spell its list whole, whatever its length, and
// words that do not spell one (a relay that died part way, a collision)
// read as no name.
func TestGroupNameWords(t *testing.T) {
	t.Parallel()
	for _, group := range []string{"a", "ab", "abc", "abcd", "abcde", "a,b", "mailers,reports", "été,日本"} {
		words := GroupNameWords(group)
		if want := 1 + (len(group)+3)/4; len(words) != want {
			t.Errorf("%q: %d words, want %d", group, len(words), want)
		}
		seen := make([]int64, len(words))
		for i, w := range words {
			seen[i] = int64(uint32(w)) // as pg_locks shows a key: unsigned
		}
		if got, ok := ReadGroupName(seen); !ok || got != group {
			t.Errorf("%q reads back as %q, %v", group, got, ok)
		}
	}
	if words := GroupNameWords(""); words != nil {
		t.Errorf("the group of every queue has name words %v, want none", words)
	}
	for _, words := range [][]int64{nil, {0}, {-1}, {5, 0x61626364}, {4, 0x61626364, 0}, {4, -1}, {2, 1 << 33}} {
		if got, ok := ReadGroupName(words); ok {
			t.Errorf("words %v read as the name %q, want none", words, got)
		}
	}
}
