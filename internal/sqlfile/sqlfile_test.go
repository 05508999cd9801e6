package sqlfile

import (
	"os"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestRender(t *testing.T) {
	st, err := Render(os.DirFS("testdata"), "ok", map[string]string{"T": `"s"."t"`})
	require.NoError(t, err)
	assert.Equal(t, []string{"A", "B", "C"}, st.Names())
	assert.Equal(t, "SELECT 1 FROM \"s\".\"t\"\n  WHERE x = $1;", st.Get("A"))
	assert.Equal(t, `DELETE FROM "s"."t"`, st.Get("B"))
	assert.Equal(t, "SELECT 2", st.Get("C"))
	assert.PanicsWithValue(t, "sqlfile: no statement named D", func() { st.Get("D") })
}

func TestRenderRefuses(t *testing.T) {
	_, err := Render(os.DirFS("testdata"), "dup", nil)
	assert.ErrorContains(t, err, `statement "A" is defined twice`)
	_, err = Render(os.DirFS("testdata"), "ok", map[string]string{})
	assert.ErrorContains(t, err, `map has no entry for key "T"`)
	_, err = Render(os.DirFS("testdata"), "none", nil)
	assert.ErrorContains(t, err, "no .sql files in none")
}

func TestParseRefuses(t *testing.T) {
	for name, src := range map[string]string{
		"SQL before the first":   "SELECT 1\n-- name: A\nSELECT 2\n",
		"a statement without a":  "-- name:\nSELECT 1\n",
		`statement "A" is empty`: "-- name: A\n\n-- name: B\nSELECT 1\n",
	} {
		_, err := Parse([]byte(src))
		assert.ErrorContains(t, err, name)
	}
}
