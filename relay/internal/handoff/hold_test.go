package handoff

import (
	"slices"
	"testing"
	"time"
)

// Where the standbys' positions cannot be read, a record field whose
// delete is flushed locally is still kept for the hold
// (Config.StandbyRetention), and only then cleared.
func TestRecordFieldHeldWhileStandbyPositionsUnknown(t *testing.T) {
	h := New(nil, Keys{})
	h.Hold = time.Minute
	h.Committed("1:1", nil, 500, 600) // flushed past the delete
	if len(h.clear) != 0 {
		t.Fatalf("clear = %v within the hold, want nothing", h.clear)
	}
	h.unflushed[0].at = time.Now().Add(-2 * time.Minute)
	h.flushed(600)
	if !slices.Equal(h.clear, []string{"1:1"}) {
		t.Fatalf("clear = %v past the hold, want [1:1]", h.clear)
	}

	h = New(nil, Keys{})
	h.Committed("1:2", nil, 500, 600) // no hold: the flush is enough
	if !slices.Equal(h.clear, []string{"1:2"}) {
		t.Fatalf("clear = %v without a hold, want [1:2]", h.clear)
	}
}
