package relay

import "testing"

// matchSchemaPattern matches as pgschema.ListSchemas's LIKE does: '*' any run of
// characters, '_' and '%' only themselves.
func TestMatchSchemaPattern(t *testing.T) {
	t.Parallel()
	for _, tt := range []struct {
		pattern, name string
		want          bool
	}{
		{"tenant_*", "tenant_1", true},
		{"tenant_*", "tenant_", true},
		{"tenant_*", "tenantx1", false},
		{"tenant_*", "my_tenant_1", false},
		{"*_eu", "acme_eu", true},
		{"*_eu", "acme_eu2", false},
		{"a*b*c", "abc", true},
		{"a*b*c", "a1b2c", true},
		{"a*b*c", "acb", false},
		{"ab*b", "ab", false},
		{"ab*b", "abb", true},
		{"*", "anything", true},
		{"t%*", "t%1", true},
		{"t%*", "tx1", false},
	} {
		if got := matchSchemaPattern(tt.pattern, tt.name); got != tt.want {
			t.Errorf("matchSchemaPattern(%q, %q) = %v, want %v", tt.pattern, tt.name, got, tt.want)
		}
	}
}
