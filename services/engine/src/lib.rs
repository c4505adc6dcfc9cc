pub fn smoke() -> f32 {
    use mlx_rs::Array;
    let a = Array::from_slice(&[1.0f32, 2.0, 3.0], &[3]);
    let b = a.multiply(&a).unwrap().sum(None).unwrap();
    b.item::<f32>()
}
#[test]
fn smoke_test() { assert_eq!(smoke(), 14.0); }
