package zeroshard;

import java.math.BigDecimal;
import java.math.MathContext;
import java.math.RoundingMode;

/** C's printf "%.Ng" in Java (String.format's %g differs), for output that matches C programs'. */
public final class CFormat {
  private CFormat() {}

  public static String g(double v, int prec) {
    if (prec == 0) prec = 1;
    if (Double.isNaN(v)) return "nan";
    if (Double.isInfinite(v)) return v > 0 ? "inf" : "-inf";
    if (v == 0.0) return (1.0 / v < 0) ? "-0" : "0";
    BigDecimal bd = new BigDecimal(v).round(new MathContext(prec, RoundingMode.HALF_EVEN));
    int x = bd.precision() - bd.scale() - 1; // decimal exponent
    String s;
    if (x < -4 || x >= prec) {
      String m = stripZeros(bd.movePointLeft(x).setScale(prec - 1, RoundingMode.HALF_EVEN).toPlainString());
      int ax = Math.abs(x);
      s = m + "e" + (x < 0 ? "-" : "+") + (ax < 10 ? "0" : "") + ax;
    } else {
      s = stripZeros(bd.setScale(Math.max(prec - 1 - x, 0), RoundingMode.HALF_EVEN).toPlainString());
    }
    return s;
  }

  public static String g(double v) { return g(v, 6); }

  private static String stripZeros(String s) {
    if (s.indexOf('.') < 0) return s;
    int end = s.length();
    while (s.charAt(end - 1) == '0') --end;
    if (s.charAt(end - 1) == '.') --end;
    return s.substring(0, end);
  }
}
